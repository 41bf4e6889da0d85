package child

import (
	"bytes"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"
)

func TestMain(m *testing.M) {
	switch Role() {
	case "ready-then-wait":
		fmt.Println("before ready")
		Ready()
		time.Sleep(time.Hour) // until killed or stopped (SIGTERM ends the process)
	case "exit-3":
		os.Exit(3)
	case "":
		os.Exit(m.Run())
	}
}

// A child reports ready, shows its other stdout lines and env, and dies by
// Kill; one stopped by SIGTERM exits by that signal; one that exits before
// ready fails WaitReady's caller (seen here through Err).
func TestChild(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	p := Start(t, Options{Role: "ready-then-wait", Stdout: &out})
	p.WaitReady(time.Minute)
	p.Kill()
	if !p.KilledBySIGKILL() {
		t.Fatalf("child not killed by SIGKILL: %v", p.Err())
	}
	if got := out.String(); got != "before ready\n" {
		t.Fatalf("stdout without the ready line: %q", got)
	}

	p = Start(t, Options{Role: "ready-then-wait"})
	p.WaitReady(time.Minute)
	err := p.Stop(time.Minute)
	if p.KilledBySIGKILL() || err == nil || err.Error() != "signal: "+syscall.SIGTERM.String() {
		t.Fatalf("a stopped child ends by SIGTERM; got %v", err)
	}

	p = Start(t, Options{Role: "exit-3", Env: []string{"X=1"}})
	if err := p.Wait(); err == nil || err.Error() != "exit status 3" {
		t.Fatalf("want exit status 3, got %v", err)
	}
}
