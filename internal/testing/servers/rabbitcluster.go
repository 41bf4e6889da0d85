package servers

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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
	// Isolated is the index of the node that runs in a network namespace
	// of its own (StartRabbitMQClusterPartitionable), -1 when none does.
	Isolated int
	netns    *Netns
	t        testing.TB
}

// StartRabbitMQCluster starts n nodes and joins them to the first; it
// returns once every node accepts AMQP connections as a cluster member.
func StartRabbitMQCluster(t testing.TB, n int) *RabbitMQCluster {
	t.Helper()
	home := clusterHome(t)
	places := make([]rabbitPlacement, n)
	for i := range places {
		places[i] = rabbitPlacement{home: home}
	}
	return startRabbitMQCluster(t, "", "", places, nil)
}

// StartRabbitMQClusterPartitionable is StartRabbitMQCluster with the first
// node (Isolated, 0) in a network namespace of its own (StartNetns), so that
// Partition can cut it off while it runs. Its URL comes first in URLs, so a
// queue declared through URLs is led by it. Erlang distribution needs every
// node reachable at its name: the nodes take long names on the two ends of
// the namespace's link, and the cluster runs an epmd of its own on both
// sides (the host's may listen on 127.0.0.1 only). The nodes tick every 10s
// (net_ticktime, 60s by default), so a partition is noticed 7.5 to 12.5s
// after the cut, and the cut-off node pauses itself
// (cluster_partition_handling = pause_minority) until it sees the others.
func StartRabbitMQClusterPartitionable(t testing.TB, n int) *RabbitMQCluster {
	t.Helper()
	if _, ok := rabbitBinDir(); !ok {
		t.Skip(noRabbitMQ) // before the epmds, which come with RabbitMQ's Erlang
	}
	home := clusterHome(t)
	ns := StartNetns(t)
	epmdPort := strconv.Itoa(FreePort(t))
	startEPMD(t, "host", exec.Command("epmd", "-port", epmdPort))
	startEPMD(t, "namespace", ns.Command("epmd", "-port", epmdPort))
	env := []string{"ERL_EPMD_PORT=" + epmdPort, "RABBITMQ_USE_LONGNAME=true"}
	places := make([]rabbitPlacement, n)
	places[0] = rabbitPlacement{home: home, host: ns.NodeIP, listen: ns.NodeIP, netns: ns, env: env}
	for i := 1; i < n; i++ {
		places[i] = rabbitPlacement{home: home, host: ns.HostIP, env: env}
	}
	// guest may log in from other than loopback: the isolated node's AMQP
	// listener is on the namespace's address.
	c := startRabbitMQCluster(t, "cluster_partition_handling = pause_minority\nloopback_users.guest = false",
		"[{kernel, [{net_ticktime, 10}]}].\n", places, ns)
	c.Isolated = 0
	return c
}

func clusterHome(t testing.TB) string {
	home, err := os.MkdirTemp("", "millrace-rmq-cluster-")
	if err != nil {
		t.Fatalf("create the cluster's cookie directory: %v", err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(home) })
	return home
}

// startEPMD runs an epmd for a partitionable cluster, stopped when t ends
// (or by a watchdog when the test binary dies).
func startEPMD(t testing.TB, where string, cmd *exec.Cmd) {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatalf("RabbitMQ cluster: start epmd (%s): %v", where, err)
	}
	dir, err := os.MkdirTemp("", "millrace-epmd-")
	if err != nil {
		_ = cmd.Process.Kill()
		t.Fatalf("RabbitMQ cluster: %v", err)
	}
	pidFile := filepath.Join(dir, "pid")
	_ = os.WriteFile(pidFile, []byte(strconv.Itoa(cmd.Process.Pid)), 0o600)
	watch(t, "epmd ("+where+")", dir, killByPIDFile("KILL", pidFile), func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
}

// startRabbitMQCluster starts a node per placement, one after another (the
// first creates the shared cookie). The others join the first as they boot,
// by peer discovery from their config (classic_config): a blank node joins
// before it opens its AMQP listener, so Start returning means it is a
// member. Joining a running node instead (stop_app, join_cluster,
// start_app) once hung in stop_app past two minutes on a loaded machine.
func startRabbitMQCluster(t testing.TB, conf, advanced string, places []rabbitPlacement, ns *Netns) *RabbitMQCluster {
	t.Helper()
	c := &RabbitMQCluster{t: t, Isolated: -1, netns: ns}
	began := time.Now()
	for i, at := range places {
		nodeConf := conf
		if i > 0 {
			nodeConf += "\ncluster_formation.peer_discovery_backend = classic_config\n" +
				"cluster_formation.classic_config.nodes.1 = " + c.Nodes[0].name + "\n"
		}
		node := newRabbitMQ(t, nodeConf, advanced, at)
		node.Start()
		c.Nodes = append(c.Nodes, node)
	}
	c.requireMembers()
	t.Logf("private RabbitMQ cluster of %d nodes up after %s", len(places), time.Since(began).Round(time.Millisecond))
	return c
}

// requireMembers fails the test unless the last node started sees every
// node in its cluster: peer discovery that finds no peer boots a node on
// its own. One rabbitmqctl call for the cluster: on a loaded machine each
// takes tens of seconds.
func (c *RabbitMQCluster) requireMembers() {
	c.t.Helper()
	last := c.Nodes[len(c.Nodes)-1]
	status := last.Ctl("cluster_status", "--formatter", "json")
	for _, n := range c.Nodes {
		if !strings.Contains(status, `"`+n.name+`"`) {
			c.t.Fatalf("private RabbitMQ node %s is not in the cluster of %s: %s", n.name, last.name, status)
		}
	}
}

// Partition cuts the Isolated node off the network (Netns.Cut): its process
// runs on, its packets are dropped both ways.
func (c *RabbitMQCluster) Partition() {
	c.t.Helper()
	c.netns.Cut()
}

// Heal ends Partition.
func (c *RabbitMQCluster) Heal() {
	c.t.Helper()
	c.netns.Heal()
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
