package servers

import (
	"os"
	"strings"
	"testing"
	"time"
)

// RabbitMQCluster is a private RabbitMQ cluster: nodes of their own (names,
// ports, data directories) on this machine, sharing an Erlang cookie and
// joined with rabbitmqctl, so that quorum queues keep members on every node
// and a test can kill, pause and restart the node that leads a queue.
type RabbitMQCluster struct {
	Nodes []*RabbitMQ
	t     testing.TB
}

// StartRabbitMQCluster starts n nodes and joins them to the first; it
// returns once every node accepts AMQP connections as a cluster member.
func StartRabbitMQCluster(t testing.TB, n int) *RabbitMQCluster {
	t.Helper()
	home, err := os.MkdirTemp("", "millrace-rmq-cluster-")
	if err != nil {
		t.Fatalf("create the cluster's cookie directory: %v", err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(home) })
	c := &RabbitMQCluster{t: t}
	began := time.Now()
	for i := range n {
		node := newRabbitMQ(t, "", "", home)
		node.Start() // one after another: the first creates the shared cookie
		if i > 0 {
			node.Ctl("stop_app")
			node.Ctl("join_cluster", c.Nodes[0].name)
			node.Ctl("start_app")
			node.Ctl("await_startup")
		}
		c.Nodes = append(c.Nodes, node)
	}
	t.Logf("private RabbitMQ cluster of %d nodes up after %s", n, time.Since(began).Round(time.Millisecond))
	return c
}

// URLs returns the nodes' AMQP URLs, comma separated, as
// broker.rabbitmq.url takes a cluster.
func (c *RabbitMQCluster) URLs() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL
	}
	return strings.Join(urls, ",")
}

// AwaitQuorumPlusOne returns once every quorum queue has more members
// online than its quorum needs, so that node i may be stopped next without
// a queue losing its quorum (rabbitmq-upgrade await_online_quorum_plus_one).
func (c *RabbitMQCluster) AwaitQuorumPlusOne(i int) {
	c.t.Helper()
	began := time.Now()
	out, err := c.Nodes[i].tool("rabbitmq-upgrade", "await_online_quorum_plus_one", "-t", "120")
	if err != nil {
		c.t.Fatalf("RabbitMQ cluster: quorum queues not at quorum + 1 after %s: %v\n%s", time.Since(began), err, out)
	}
}

// QueueLeader returns the index of the node that leads the quorum queue,
// asking the first running node in via; -1 when none says.
func (c *RabbitMQCluster) QueueLeader(queue string, via ...int) int {
	c.t.Helper()
	for _, i := range via {
		out, err := c.Nodes[i].ctl("list_queues", "-q", "--no-table-headers", "name", "leader")
		if err != nil {
			continue
		}
		for line := range strings.SplitSeq(out, "\n") {
			name, leader, ok := strings.Cut(strings.TrimSpace(line), "\t")
			if !ok || name != queue {
				continue
			}
			for j, n := range c.Nodes {
				if n.name == strings.TrimSpace(leader) {
					return j
				}
			}
		}
	}
	return -1
}
