package servers

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// natsServerModule is the module the private servers' binary is built
// from, at the version go.mod requires (the one package natsdev links).
const natsServerModule = "github.com/nats-io/nats-server/v2"

// natsBuildTimeout bounds building the binary, waiting for another test
// process's build included: on a busy 2-core machine, with the standard
// library compiled and the modules to download, about three minutes; with
// an empty build cache at a load average near 38, more than ten.
const natsBuildTimeout = 20 * time.Minute

var natsBin struct {
	once sync.Once
	path string
	err  error
}

// natsServerBin returns the nats-server binary private servers run:
// NATS_SERVER_BIN when set, else one built from the nats-server module at
// the version go.mod requires, once per test process and cached between
// runs. A failed build fails the test; no other binary is tried.
func natsServerBin(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("NATS_SERVER_BIN"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("NATS_SERVER_BIN: %v", err)
		}
		return p
	}
	natsBin.once.Do(func() {
		began := time.Now()
		natsBin.path, natsBin.err = buildNATSServer()
		if natsBin.err == nil {
			t.Logf("nats-server binary %s ready after %s", natsBin.path, time.Since(began).Round(time.Millisecond))
		}
	})
	if natsBin.err != nil {
		t.Fatalf("build nats-server from %s: %v", natsServerModule, natsBin.err)
	}
	return natsBin.path
}

// buildNATSServer builds the binary into a cache directory named by the
// module's version, unless a binary of that version is there already. A
// lock file serialises test processes building at once; the binary is
// built under a temporary name and renamed, so nothing ever runs a
// half-written one.
func buildNATSServer() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), natsBuildTimeout)
	defer cancel()
	goBin, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("the go command is needed to build it: %w", err)
	}
	version, replaced, err := natsModuleVersion(ctx, goBin)
	if err != nil {
		return "", err
	}
	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	dir := filepath.Join(base, "millrace", "nats-server", version+"-"+runtime.GOOS+"-"+runtime.GOARCH)
	if replaced {
		// A replaced module (a local checkout) may change under the same
		// version: build it afresh in a directory of this process's.
		if dir, err = os.MkdirTemp("", "millrace-nats-server-"); err != nil {
			return "", err
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	unlock, err := lockFile(ctx, filepath.Join(dir, "lock"))
	if err != nil {
		return "", err
	}
	defer unlock()

	bin := filepath.Join(dir, "nats-server")
	if !replaced && binaryVersionIs(ctx, bin, version) {
		return bin, nil
	}
	tmp := fmt.Sprintf("%s.tmp%d", bin, os.Getpid())
	defer os.Remove(tmp)
	build := exec.CommandContext(ctx, goBin, "build", "-o", tmp, natsServerModule)
	build.Dir = moduleRoot()
	if out, err := build.CombinedOutput(); err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("not built within %s: %w", natsBuildTimeout, ctx.Err())
		}
		return "", fmt.Errorf("go build: %w\n%s", err, tail(string(out), 3000))
	}
	if !replaced && !binaryVersionIs(ctx, tmp, version) {
		return "", fmt.Errorf("the built binary does not report version %s", version)
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", err
	}
	return bin, nil
}

// natsModuleVersion asks the go command which version of the nats-server
// module the main module requires, and whether a replace directive points
// it elsewhere.
func natsModuleVersion(ctx context.Context, goBin string) (version string, replaced bool, err error) {
	cmd := exec.CommandContext(ctx, goBin, "list", "-m", "-f", "{{.Version}} {{if .Replace}}replaced{{end}}", natsServerModule)
	cmd.Dir = moduleRoot()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", false, fmt.Errorf("go list -m %s: %w\n%s", natsServerModule, err, stderr.String())
	}
	fields := strings.Fields(string(out))
	if len(fields) == 0 {
		return "", false, fmt.Errorf("go list -m %s printed no version", natsServerModule)
	}
	return fields[0], len(fields) > 1, nil
}

// moduleRoot is the directory of millrace's go.mod, found from this source
// file so that the build uses go.mod's versions whatever the working
// directory of the test.
func moduleRoot() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok || !filepath.IsAbs(file) {
		return "" // built with -trimpath: the working directory, inside the module
	}
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// binaryVersionIs reports whether bin runs and reports version.
func binaryVersionIs(ctx context.Context, bin, version string) bool {
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	return err == nil && strings.TrimSpace(string(out)) == "nats-server: "+version
}

// lockFile takes an exclusive flock on path, polling until ctx ends (a
// blocking flock could not be bounded), and returns its release.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("lock %s: another test process is still building: %w", path, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}
