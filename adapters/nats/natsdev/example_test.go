package natsdev_test

import (
	"fmt"
	"os"

	"github.com/millrace-io/millrace/adapters/nats/natsdev"
)

// Start runs a JetStream server in the process, e.g. for tests.
func ExampleStart() {
	storeDir, _ := os.MkdirTemp("", "millrace-example")
	defer os.RemoveAll(storeDir)

	srv, err := natsdev.Start("nats://127.0.0.1:0", natsdev.Options{StoreDir: storeDir, Sync: "2m"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer srv.Shutdown()
	fmt.Println(srv.Port() > 0)
	// Output: true
}
