package servers

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// RabbitMQ is a RabbitMQ node of its own (own node name, ports, data and
// log directories) that a test may stop, restart and reconfigure without
// touching the shared server other tests use.
type RabbitMQ struct {
	t       testing.TB
	bin     string // directory holding rabbitmq-server and rabbitmqctl
	dir     string
	name    string
	env     []string // os.Environ() and own
	own     []string // the node's own variables
	pidFile string
	netns   *Netns // the network namespace the node runs in; nil: the host's
	// URL is the node's AMQP URL (user guest, default virtual host).
	URL string
}

// rabbitPlacement says where a node runs and how it is named: by default on
// the host, as name@localhost, listening on 127.0.0.1, with the host's
// epmd. A partitionable cluster's nodes take Erlang long names on an
// address of their own and an epmd of their own (rabbitcluster.go).
type rabbitPlacement struct {
	home   string   // holds the Erlang cookie; nodes of one cluster share it
	host   string   // the host part of the node name; default localhost
	listen string   // the AMQP listener's address; default 127.0.0.1
	netns  *Netns   // run the node and its tools in this namespace
	env    []string // more variables for the node and its tools
}

// noRabbitMQ is why a test that needs a private RabbitMQ node is skipped.
const noRabbitMQ = "no rabbitmq-server installed here to start a private node from (the test restarts its broker, so it never uses a shared one)"

// rabbitBinDir finds the RabbitMQ scripts: the Debian/Ubuntu package keeps
// the real ones in /usr/lib/rabbitmq/bin (its /usr/sbin wrappers switch to
// the rabbitmq user and its data directory); other installs put them on PATH.
func rabbitBinDir() (string, bool) {
	if _, err := os.Stat("/usr/lib/rabbitmq/bin/rabbitmq-server"); err == nil {
		return "/usr/lib/rabbitmq/bin", true
	}
	if p, err := exec.LookPath("rabbitmq-server"); err == nil {
		return filepath.Dir(p), true
	}
	return "", false
}

// StartRabbitMQ starts a private RabbitMQ node, stopped when t ends.
// rabbitmqConf and advancedConfig are appended to its rabbitmq.conf and
// written as its advanced.config (may be empty). The test is skipped, saying why, when no
// RabbitMQ installation is there to start one from.
func StartRabbitMQ(t testing.TB, rabbitmqConf, advancedConfig string) *RabbitMQ {
	t.Helper()
	n := newRabbitMQ(t, rabbitmqConf, advancedConfig, rabbitPlacement{})
	n.Start()
	return n
}

// newRabbitMQ prepares a private node without starting it, placed as at
// says.
func newRabbitMQ(t testing.TB, rabbitmqConf, advancedConfig string, at rabbitPlacement) *RabbitMQ {
	t.Helper()
	bin, ok := rabbitBinDir()
	if !ok {
		t.Skip(noRabbitMQ)
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	// The data directory goes to /tmp: RabbitMQ's paths must stay short.
	dir, err := os.MkdirTemp("", "millrace-rmq-")
	require.NoError(t, err)
	n := &RabbitMQ{
		t:       t,
		bin:     bin,
		dir:     dir,
		name:    "millrace" + hex.EncodeToString(suffix) + "@" + cmp.Or(at.host, "localhost"),
		pidFile: filepath.Join(dir, "pid"),
		netns:   at.netns,
	}
	listen := cmp.Or(at.listen, "127.0.0.1")
	port, distPort := FreePort(t), FreePort(t)
	n.URL = fmt.Sprintf("amqp://guest:guest@%s:%d/", listen, port)
	conf := fmt.Sprintf("listeners.tcp.1 = %s:%d\nlog.file.level = warning\n%s\n", listen, port, rabbitmqConf)
	files := map[string]string{
		"env.conf":        "",
		"enabled_plugins": "[].\n",
		"rabbitmq.conf":   conf,
		"advanced.config": advancedConfig,
	}
	if advancedConfig == "" {
		files["advanced.config"] = "[].\n"
	}
	for name, content := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600))
	}
	n.own = []string{
		"HOME=" + cmp.Or(at.home, dir), // the Erlang cookie of the node and of rabbitmqctl
		"RABBITMQ_NODENAME=" + n.name,
		"RABBITMQ_DIST_PORT=" + strconv.Itoa(distPort),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(dir, "env.conf"),
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE=" + filepath.Join(dir, "advanced.config"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(dir, "enabled_plugins"),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(dir, "mnesia"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(dir, "log"),
		"RABBITMQ_PID_FILE=" + n.pidFile,
	}
	n.own = append(n.own, at.env...)
	n.env = append(os.Environ(), n.own...)
	watch(t, "private RabbitMQ node", dir, killByPIDFile("KILL", n.pidFile), n.Stop)
	return n
}

// Start starts the node and returns once it accepts AMQP connections.
func (n *RabbitMQ) Start() {
	n.t.Helper()
	began := time.Now()
	cmd := n.command(context.Background(), "rabbitmq-server", "-detached")
	out, err := cmd.CombinedOutput()
	require.NoError(n.t, err, "rabbitmq-server -detached: %s", out)
	// A cluster node restarted while its peers run waits for their tables:
	// on a loaded 2-core machine that took up to 1m41s.
	deadline := time.Now().Add(4 * time.Minute)
	for {
		conn, err := amqp.Dial(n.URL)
		if err == nil {
			_ = conn.Close()
			n.t.Logf("private RabbitMQ node %s up after %s", n.name, time.Since(began).Round(time.Millisecond))
			return
		}
		if time.Now().After(deadline) {
			logs, _ := os.ReadFile(filepath.Join(n.dir, "log", n.name+".log"))
			require.FailNow(n.t, "private RabbitMQ node did not start", "%v\n%s", err, tail(string(logs), 3000))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Stop stops the node (SIGTERM, a clean shutdown) and waits for its process
// to end. It does nothing when the node is not running.
func (n *RabbitMQ) Stop() {
	n.t.Helper()
	pid := n.pid()
	if pid == 0 {
		return
	}
	began := time.Now()
	_ = syscall.Kill(pid, syscall.SIGCONT) // a paused node handles nothing else
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		_ = os.Remove(n.pidFile)
		return
	}
	for time.Since(began) < time.Minute {
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
			_ = os.Remove(n.pidFile)
			n.t.Logf("private RabbitMQ node %s stopped after %s", n.name, time.Since(began).Round(time.Millisecond))
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	_ = os.Remove(n.pidFile)
}

// pid is the node's operating-system process, 0 when it is not running.
func (n *RabbitMQ) pid() int {
	raw, err := os.ReadFile(n.pidFile)
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil || pid <= 0 {
		return 0
	}
	return pid
}

// Kill kills the node (SIGKILL: no shutdown) and waits for it to be gone.
func (n *RabbitMQ) Kill() {
	n.t.Helper()
	pid := n.pid()
	if pid == 0 {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for syscall.Kill(pid, 0) == nil {
		time.Sleep(20 * time.Millisecond)
	}
	_ = os.Remove(n.pidFile)
	n.t.Logf("private RabbitMQ node %s killed", n.name)
}

// Pause freezes the node (SIGSTOP), as a hung node; Resume wakes it.
func (n *RabbitMQ) Pause() { n.t.Helper(); n.freeze(syscall.SIGSTOP, "paused") }

// Resume wakes a paused node (SIGCONT).
func (n *RabbitMQ) Resume() { n.t.Helper(); n.freeze(syscall.SIGCONT, "resumed") }

func (n *RabbitMQ) freeze(sig syscall.Signal, what string) {
	n.t.Helper()
	pid := n.pid()
	if pid == 0 {
		n.t.Fatalf("private RabbitMQ node %s: %s while it is not running", n.name, what)
	}
	require.NoError(n.t, syscall.Kill(pid, sig))
	n.t.Logf("private RabbitMQ node %s %s", n.name, what)
}

// Restart stops the node and starts it again on the same data directory.
func (n *RabbitMQ) Restart() {
	n.t.Helper()
	n.Stop()
	n.Start()
}

// RestartScript writes a shell script that restarts the node the way
// Restart does, for tools that take a command (Watermill's TestReconnect).
func (n *RabbitMQ) RestartScript() string {
	n.t.Helper()
	var env strings.Builder
	for _, kv := range n.own {
		k, v, _ := strings.Cut(kv, "=")
		fmt.Fprintf(&env, "export %s='%s'\n", k, v)
	}
	port := n.URL[strings.LastIndex(n.URL, ":")+1 : len(n.URL)-1]
	script := fmt.Sprintf(`#!/bin/bash
%s
pid=$(cat "$RABBITMQ_PID_FILE")
kill -TERM "$pid"
while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
rm -f "$RABBITMQ_PID_FILE"
'%s/rabbitmq-server' -detached
i=0
until (exec 3<>/dev/tcp/127.0.0.1/%s) 2>/dev/null; do
	i=$((i+1)); [ $i -gt 1200 ] && exit 1
	sleep 0.1
done
`, env.String(), n.bin, port)
	path := filepath.Join(n.dir, "restart.sh")
	require.NoError(n.t, os.WriteFile(path, []byte(script), 0o700))
	return path
}

// Ctl runs rabbitmqctl against the node; the test fails when it does.
func (n *RabbitMQ) Ctl(args ...string) string {
	n.t.Helper()
	out, err := n.ctl(args...)
	require.NoError(n.t, err, "rabbitmqctl %s: %s", strings.Join(args, " "), out)
	return out
}

// MemoryAlarm raises the node's memory alarm (a memory high watermark of
// 0) or clears it (the default watermark, 0.4), and returns once the node's
// alarm list says so: rabbitmqctl returns before the memory monitor has
// told the alarm handler, and a publish arriving in between is confirmed
// as if there were no alarm.
func (n *RabbitMQ) MemoryAlarm(raise bool) {
	n.t.Helper()
	watermark := "0.4"
	if raise {
		watermark = "0"
	}
	n.Ctl("set_vm_memory_high_watermark", watermark)
	deadline := time.Now().Add(time.Minute)
	for {
		// The alarm handler has alerted the connections when it lists the alarm.
		alarms := n.Ctl("eval", "rabbit_alarm:get_alarms().")
		if strings.Contains(alarms, "resource_limit,memory") == raise {
			return
		}
		require.True(n.t, time.Now().Before(deadline), "private RabbitMQ node %s: memory alarm still %v after a minute: %s", n.name, !raise, alarms)
		time.Sleep(50 * time.Millisecond)
	}
}

// ctl runs rabbitmqctl against the node, bounded by a minute.
func (n *RabbitMQ) ctl(args ...string) (string, error) { return n.tool("rabbitmqctl", args...) }

// tool runs one of RabbitMQ's command-line tools against the node, bounded
// by two minutes.
func (n *RabbitMQ) tool(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := n.command(ctx, name, append([]string{"-n", n.name}, args...)...).CombinedOutput()
	return string(out), err
}

// command runs one of RabbitMQ's scripts with the node's environment, in
// the node's network namespace if it has one.
func (n *RabbitMQ) command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(n.bin, name), args...)
	if n.netns != nil {
		cmd = n.netns.CommandContext(ctx, filepath.Join(n.bin, name), args...)
	}
	cmd.Env = n.env
	return cmd
}
