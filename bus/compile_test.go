package bus_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A value of another type than the topic's does not compile: a program
// publishing an InvoiceIssued on a Topic[OrderPlaced] fails to build, at
// that argument.
func TestPublishingAnotherTypeDoesNotCompile(t *testing.T) {
	t.Parallel()
	// Inside the module, so that the build resolves millrace; the leading
	// underscore keeps ./... patterns off it.
	dir, err := os.MkdirTemp(".", "_compilecheck")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	program := `package main

import (
	"context"

	"github.com/millrace-io/millrace/bus"
)

type OrderPlaced struct{ OrderID string }

func (OrderPlaced) EventType() string { return "OrderPlaced" }

type InvoiceIssued struct{ InvoiceID string }

func main() {
	orderPlaced := bus.Must(bus.NewTopic[OrderPlaced]("orders.events"))
	_ = orderPlaced.Publish(context.Background(), nil, nil, InvoiceIssued{InvoiceID: "inv-1"})
}
`
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(program), 0o600))
	out, err := exec.Command("go", "build", "-o", os.DevNull, "./"+dir).CombinedOutput()
	require.Error(t, err, "the program must not build:\n%s", out)
	require.Contains(t, string(out), "main.go:17:")
	require.Contains(t, string(out), "cannot use InvoiceIssued{…} (value of struct type InvoiceIssued) as OrderPlaced value in argument to orderPlaced.Publish")
}
