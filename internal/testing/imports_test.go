package testing_test

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

// No runtime package (its non-test files) imports test support, directly
// or through another package.
func TestNoRuntimePackageImportsTestSupport(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-json=ImportPath,Deps", "github.com/millrace-io/millrace/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	const support = "github.com/millrace-io/millrace/internal/testing"
	dec := json.NewDecoder(strings.NewReader(string(out)))
	checked := 0
	for dec.More() {
		var p struct {
			ImportPath string
			Deps       []string
		}
		if err := dec.Decode(&p); err != nil {
			t.Fatalf("decode go list: %v", err)
		}
		if strings.HasPrefix(p.ImportPath, support) {
			continue
		}
		checked++
		for _, d := range p.Deps {
			if strings.HasPrefix(d, support) {
				t.Errorf("%s imports %s: test support belongs in _test.go files", p.ImportPath, d)
			}
		}
	}
	if checked < 10 {
		t.Fatalf("checked only %d packages: go list gave %d bytes", checked, len(out))
	}
}
