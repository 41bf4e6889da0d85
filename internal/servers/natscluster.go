package servers

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSCluster is a private JetStream cluster: nats-server processes joined
// by routes, each with its own ports and store directory, so that streams
// can keep replicas on several nodes and a test can kill, pause and restart
// the node that leads a stream.
type NATSCluster struct {
	// Nodes are the cluster's servers, named node0, node1, ... in order.
	Nodes []*NATS
	t     testing.TB
}

// StartNATSCluster starts a cluster of n nodes and returns once JetStream
// answers on every node (the cluster has elected its meta leader).
func StartNATSCluster(t testing.TB, n int) *NATSCluster {
	t.Helper()
	c := &NATSCluster{t: t}
	routePorts := make([]int, n)
	for i := range n {
		c.Nodes = append(c.Nodes, newNATS(t))
		routePorts[i] = FreePort(t)
	}
	clusterName := "millrace" + strconv.Itoa(routePorts[0])
	for i, node := range c.Nodes {
		var routes []string
		for j, p := range routePorts {
			if j != i {
				routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", p))
			}
		}
		node.clustered = true
		node.args = []string{"-n", NodeName(i), "--cluster_name", clusterName,
			"--cluster", fmt.Sprintf("nats://127.0.0.1:%d", routePorts[i]), "--routes", strings.Join(routes, ",")}
		node.Start()
	}
	c.WaitJetStream()
	return c
}

// NodeName is the server name of the cluster's i-th node.
func NodeName(i int) string { return "node" + strconv.Itoa(i) }

// URLs returns the nodes' client URLs, comma separated, as nats.Connect
// takes a server list.
func (c *NATSCluster) URLs() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL
	}
	return strings.Join(urls, ",")
}

// WaitJetStream returns once JetStream answers on every running node.
func (c *NATSCluster) WaitJetStream() {
	c.t.Helper()
	began := time.Now()
	for _, n := range c.Nodes {
		for err := n.ping(true); err != nil; err = n.ping(true) {
			if time.Since(began) > 2*time.Minute {
				c.t.Fatalf("JetStream cluster: node on port %d has no JetStream after %s: %v\n%s", n.port, time.Since(began), err, n.logTail())
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	// JetStream answers before its meta group knows every peer; a stream
	// placed on all nodes shows that it does.
	for err := c.probePlacement(); err != nil; err = c.probePlacement() {
		if time.Since(began) > 2*time.Minute {
			c.t.Fatalf("JetStream cluster: a stream at %d replicas cannot be placed after %s: %v", len(c.Nodes), time.Since(began), err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	c.t.Logf("private NATS cluster of %d nodes has JetStream after %s", len(c.Nodes), time.Since(began).Round(time.Millisecond))
}

// WaitStreamCurrent returns once stream has a leader and every other node
// holds a current replica, so that the next node restarted leaves a quorum.
func (c *NATSCluster) WaitStreamCurrent(ctx context.Context, stream string) {
	c.t.Helper()
	began := time.Now()
	for {
		err := c.streamCurrent(ctx, stream)
		if err == nil {
			return
		}
		if time.Since(began) > 2*time.Minute {
			c.t.Fatalf("JetStream cluster: stream %q not replicated after %s: %v", stream, time.Since(began), err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (c *NATSCluster) streamCurrent(ctx context.Context, stream string) error {
	info, err := c.streamInfo(ctx, stream)
	if err != nil {
		return err
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return fmt.Errorf("stream %q has no leader", stream)
	}
	if len(info.Cluster.Replicas) != len(c.Nodes)-1 {
		return fmt.Errorf("stream %q has %d replicas besides its leader", stream, len(info.Cluster.Replicas))
	}
	for _, r := range info.Cluster.Replicas {
		if !r.Current || r.Offline {
			return fmt.Errorf("stream %q: replica on %s is not current", stream, r.Name)
		}
	}
	return nil
}

func (c *NATSCluster) streamInfo(ctx context.Context, stream string) (*jetstream.StreamInfo, error) {
	nc, err := nats.Connect(c.URLs(), nats.Timeout(2*time.Second))
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	return s.CachedInfo(), nil
}

// probePlacement creates and deletes a memory stream with a replica on
// every node.
func (c *NATSCluster) probePlacement() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	nc, err := nats.Connect(c.URLs(), nats.Timeout(2*time.Second))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	const probe = "MILLRACE_PLACEMENT_PROBE"
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: probe, Subjects: []string{"millrace.placement.probe"},
		Replicas: len(c.Nodes), Storage: jetstream.MemoryStorage}); err != nil {
		return err
	}
	return js.DeleteStream(ctx, probe)
}

// StreamLeader returns the index of the node that leads stream, asking
// through any node that answers.
func (c *NATSCluster) StreamLeader(ctx context.Context, stream string) (int, error) {
	info, err := c.streamInfo(ctx, stream)
	if err != nil {
		return -1, err
	}
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return -1, fmt.Errorf("stream %q has no leader", stream)
	}
	for i := range c.Nodes {
		if NodeName(i) == info.Cluster.Leader {
			return i, nil
		}
	}
	return -1, fmt.Errorf("stream %q is led by %q, not a node of this cluster", stream, info.Cluster.Leader)
}
