package servers

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
)

// Netns is a network namespace of its own, joined to the host by a veth
// pair: the host's end has HostIP, the namespace's end NodeIP (a /30 of
// 10.213.0.0/16 each). A server started inside it is reached from the host
// at NodeIP; Cut takes the namespace's end of the link down, so that its
// packets are dropped both ways, as on a network partition, while the
// server keeps running and its sockets stay open.
type Netns struct {
	// Name is the namespace's name, as `ip netns` knows it.
	Name string
	// HostIP is the address of the link's host end, NodeIP the address
	// of its end inside the namespace.
	HostIP, NodeIP string

	t                  testing.TB
	ip                 string // the iproute2 binary
	hostLink, nodeLink string

	mu  sync.Mutex
	cut bool
}

// StartNetns creates a network namespace joined to the host by a veth pair
// with addresses of its own, up and reachable, and deletes it (and with it
// the pair) when t ends, after the cleanups registered later (the servers
// in it) have run; a watchdog deletes it if the test binary dies first. It
// needs root and iproute2; the test fails without them.
func StartNetns(t testing.TB) *Netns {
	t.Helper()
	ip, err := exec.LookPath("ip")
	if err != nil {
		t.Fatalf("a network namespace needs iproute2's ip command: %v", err)
	}
	if os.Geteuid() != 0 {
		t.Fatalf("a network namespace needs root (ip netns add), and this test runs as uid %d", os.Geteuid())
	}
	// A random /30 and names made of its number: `ip netns add` fails on a
	// name taken, so parallel tests and test processes never share one.
	for range 20 {
		id := rand.IntN(1 << 14)
		n := &Netns{
			Name:     fmt.Sprintf("millrace-%d", id),
			HostIP:   fmt.Sprintf("10.213.%d.%d", id>>6, (id&63)*4+1),
			NodeIP:   fmt.Sprintf("10.213.%d.%d", id>>6, (id&63)*4+2),
			t:        t,
			ip:       ip,
			hostLink: fmt.Sprintf("mrh%d", id),
			nodeLink: fmt.Sprintf("mrn%d", id),
		}
		if err := n.run("netns", "add", n.Name); err != nil {
			if strings.Contains(err.Error(), "exists") {
				continue
			}
			t.Fatalf("create a network namespace: %v", err)
		}
		if err := n.setUp(); err != nil {
			_ = n.run("netns", "del", n.Name)
			_ = n.run("link", "del", n.hostLink)
			if strings.Contains(err.Error(), "exists") { // a pair left by a killed run
				continue
			}
			t.Fatalf("network namespace %s: %v", n.Name, err)
		}
		n.watch()
		return n
	}
	t.Fatalf("no free network namespace name after 20 tries")
	return nil
}

// setUp creates the veth pair, its addresses, and brings it up.
func (n *Netns) setUp() error {
	steps := [][]string{
		{"link", "add", n.hostLink, "type", "veth", "peer", "name", n.nodeLink, "netns", n.Name},
		{"addr", "add", n.HostIP + "/30", "dev", n.hostLink},
		{"link", "set", n.hostLink, "up"},
		{"-n", n.Name, "addr", "add", n.NodeIP + "/30", "dev", n.nodeLink},
		{"-n", n.Name, "link", "set", n.nodeLink, "up"},
		{"-n", n.Name, "link", "set", "lo", "up"},
	}
	for _, step := range steps {
		if err := n.run(step...); err != nil {
			return err
		}
	}
	return nil
}

// watch deletes the namespace when the test ends, or when the test binary
// dies (a watchdog).
func (n *Netns) watch() {
	n.t.Helper()
	dir, err := os.MkdirTemp("", "millrace-netns-")
	if err != nil {
		_ = n.run("netns", "del", n.Name)
		n.t.Fatalf("network namespace %s: %v", n.Name, err)
	}
	remove := fmt.Sprintf("%[1]s netns del %[2]s 2>/dev/null; %[1]s link del %[3]s 2>/dev/null", n.ip, n.Name, n.hostLink)
	watch(n.t, "network namespace "+n.Name, dir, remove, func() {
		if err := n.run("netns", "del", n.Name); err != nil {
			n.t.Errorf("delete network namespace %s: %v", n.Name, err)
		}
		_ = n.run("link", "del", n.hostLink) // gone with the namespace's end, unless a process kept the namespace alive
	})
}

// Command returns a command that runs name inside the namespace (`ip netns
// exec` switches namespace and execs it: the process is name's own).
func (n *Netns) Command(name string, args ...string) *exec.Cmd {
	return n.CommandContext(context.Background(), name, args...)
}

// CommandContext is Command, killed when ctx ends.
func (n *Netns) CommandContext(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, n.ip, append([]string{"netns", "exec", n.Name, name}, args...)...)
}

// Cut takes the namespace's end of the link down: nothing passes between
// the namespace and the host until Heal.
func (n *Netns) Cut() {
	n.t.Helper()
	n.setLink(true)
}

// Heal brings the link back up after Cut.
func (n *Netns) Heal() {
	n.t.Helper()
	n.setLink(false)
}

func (n *Netns) setLink(cut bool) {
	n.t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cut == cut {
		n.t.Fatalf("network namespace %s: already %s", n.Name, map[bool]string{true: "cut", false: "connected"}[cut])
	}
	state := "up"
	if cut {
		state = "down"
	}
	if err := n.run("-n", n.Name, "link", "set", n.nodeLink, state); err != nil {
		n.t.Fatalf("network namespace %s: %v", n.Name, err)
	}
	n.cut = cut
	n.t.Logf("network namespace %s (%s): link %s", n.Name, n.NodeIP, state)
}

// run runs ip with args and returns its output in the error when it fails.
func (n *Netns) run(args ...string) error {
	out, err := exec.Command(n.ip, args...).CombinedOutput()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return fmt.Errorf("ip %s: %s", strings.Join(args, " "), strings.TrimSpace(string(out)))
		}
		return fmt.Errorf("ip %s: %w", strings.Join(args, " "), err)
	}
	return nil
}
