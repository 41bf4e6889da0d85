package servers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
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
// the node that leads a stream, or, in a cluster from
// StartNATSClusterPartitionable, cut one node off the network.
type NATSCluster struct {
	// Nodes are the cluster's servers, named node0, node1, ... in order.
	Nodes []*NATS
	// Isolated is the index of the node in a network namespace of its own
	// (see StartNATSClusterPartitionable), -1 when every node runs on the
	// host.
	Isolated int

	netns *Netns
	t     testing.TB
}

// StartNATSCluster starts a cluster of n nodes on 127.0.0.1 and returns
// once JetStream answers on every node (the cluster has elected its meta
// leader).
func StartNATSCluster(t testing.TB, n int) *NATSCluster {
	t.Helper()
	return startNATSCluster(t, n, nil)
}

// StartNATSClusterPartitionable starts a cluster of n nodes whose last node
// (Isolated) runs in a network namespace of its own (StartNetns), joined to
// the others by a veth pair: the host's nodes take clients on 127.0.0.1 and
// routes on the pair's host address, the isolated node both on the
// namespace's address. Partition cuts the isolated node off, Heal joins it
// again. It needs root and iproute2.
func StartNATSClusterPartitionable(t testing.TB, n int) *NATSCluster {
	t.Helper()
	return startNATSCluster(t, n, StartNetns(t))
}

func startNATSCluster(t testing.TB, n int, ns *Netns) *NATSCluster {
	t.Helper()
	c := &NATSCluster{t: t, Isolated: -1, netns: ns}
	routes := make([]string, n)
	for i := range n {
		routeHost := "127.0.0.1"
		var node *NATS
		switch {
		case ns == nil:
			node = newNATS(t)
		case i == n-1:
			node, routeHost, c.Isolated = newNATSIn(t, ns), ns.NodeIP, i
		default:
			node, routeHost = newNATS(t), ns.HostIP
		}
		c.Nodes = append(c.Nodes, node)
		routes[i] = fmt.Sprintf("nats://%s:%d", routeHost, FreePort(t))
	}
	clusterName := "millrace" + strconv.Itoa(c.Nodes[0].port)
	for i, node := range c.Nodes {
		others := slices.Delete(slices.Clone(routes), i, i+1)
		node.clustered = true
		node.args = []string{"-n", NodeName(i), "--cluster_name", clusterName,
			"--cluster", routes[i], "--routes", strings.Join(others, ",")}
		node.Start()
	}
	c.WaitJetStream()
	return c
}

// Partition cuts the isolated node off the network: it keeps running, the
// other nodes and the clients on the host no longer reach it, nor it them.
func (c *NATSCluster) Partition() {
	c.t.Helper()
	if c.netns == nil {
		c.t.Fatalf("JetStream cluster: Partition needs a cluster from StartNATSClusterPartitionable")
	}
	c.netns.Cut()
}

// Heal joins the isolated node to the network again after Partition.
func (c *NATSCluster) Heal() {
	c.t.Helper()
	if c.netns == nil {
		c.t.Fatalf("JetStream cluster: Heal needs a cluster from StartNATSClusterPartitionable")
	}
	c.netns.Heal()
}

// MoveStreamLeader asks the stream's leader to step down in favour of node
// to (a stepdown with a preferred placement) and returns once to leads
// the stream.
func (c *NATSCluster) MoveStreamLeader(ctx context.Context, stream string, to int) error {
	began := time.Now()
	for {
		leader, err := c.StreamLeader(ctx, stream)
		if err == nil && leader == to {
			c.t.Logf("JetStream cluster: %s leads stream %q after %s", NodeName(to), stream, time.Since(began).Round(time.Millisecond))
			return nil
		}
		if time.Since(began) > time.Minute {
			return fmt.Errorf("stream %q: %s does not lead it a minute after asking (leader %d, %v)", stream, NodeName(to), leader, err)
		}
		if err == nil {
			if err := c.stepDown(ctx, stream, NodeName(to)); err != nil {
				c.t.Logf("JetStream cluster: stream %q stepdown: %v", stream, err)
			}
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// stepDown sends the stream's leader a stepdown request naming the node
// preferred to lead it next (no client library call takes a placement).
func (c *NATSCluster) stepDown(ctx context.Context, stream, preferred string) error {
	nc, err := nats.Connect(c.URLs(), nats.Timeout(2*time.Second))
	if err != nil {
		return err
	}
	defer nc.Close()
	req := fmt.Sprintf(`{"placement":{"preferred":%q}}`, preferred)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	msg, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.LEADER.STEPDOWN."+stream, []byte(req))
	if err != nil {
		return err
	}
	var resp struct {
		Error *struct {
			Description string `json:"description"`
		} `json:"error"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return fmt.Errorf("stepdown answer %q: %w", msg.Data, err)
	}
	if resp.Error != nil {
		return errors.New(resp.Error.Description)
	}
	return nil
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
