package faults

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/millrace-io/millrace/adapters/nats"
	"github.com/millrace-io/millrace/adapters/rabbit"
	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
	"github.com/millrace-io/millrace/ops"
)

// The scenarios, in the order docs/RELIABILITY.md lists them.
const (
	relayKilled    = "relay SIGKILLed at random points"
	consumerKilled = "consumer SIGKILLed after its effect committed, before the ack"
	// consumerKilledBatched is consumerKilled with unordered consumers.
	consumerKilledBatched = "unordered consumer SIGKILLed after its batch committed, before the acks"
	// consumerKilledRetrying is consumerKilledBatched with failed attempts
	// waiting at the broker (Kafka: broker.kafka.retry_topics).
	consumerKilledRetrying = "unordered consumer SIGKILLed while failed messages wait at the broker for their next attempt"
	consumerPaused         = "consumer hung (SIGSTOP) past the broker's failure detection, then resumed"
	brokerRestarted        = "broker restarted mid-flow"
	postgresCrashed        = "PostgreSQL crash-restarted mid-flow"
	terminated             = "SIGTERM mid-batch"
	twoOfEach              = "two relays and two consumer replicas, one SIGKILLed"
	poisonStorm            = "poison storm: 1% malformed"
	dependencyOutage       = "dependency outage behind the circuit breaker"
	relayOutage            = "relay outage, then a rate-limited drain"
	clusterFaults          = "3-node cluster: leader killed, leader hung 15 s (NATS, RabbitMQ) or every leader moved (Kafka), rolling restart"
	clusterPartition       = "3-node cluster: stream or queue leader cut off the network (20 s or more), then healed"
)

var scenarioOrder = []string{relayKilled, consumerKilled, consumerKilledBatched, consumerKilledRetrying, consumerPaused, brokerRestarted, postgresCrashed, terminated,
	twoOfEach, poisonStorm, dependencyOutage, relayOutage, clusterFaults, clusterPartition,
	idleInTransaction, neighbourFrozen, pooledRelays, failoverSync, failoverAsync,
	walRelayKilled, walPostgres, walBrokerFrozen, walSlotDropped, walOpenTx}

func scenarioRank(name string) int { return slices.Index(scenarioOrder, name) }

// eachBroker runs scenario on every broker kind, in parallel.
func eachBroker(t *testing.T, kinds []string, scenario func(t *testing.T, kind string)) {
	t.Parallel()
	testkit.Each(t, kinds, scenario)
}

// rate is how many events per second the service commits while faults are
// injected: 200 in the run that writes docs/RELIABILITY.md (`make
// reliability`), 100 otherwise (`make test`). The suite's two cores are
// busy for all of its run, so its duration follows the events its
// processes handle; the faults, their timing and the checks are the same.
var rate = map[bool]int{true: 200, false: 100}[os.Getenv(reportEnv) != ""]

// settleTimeout bounds each scenario's recovery.
const settleTimeout = 5 * time.Minute

func newRand() *rand.Rand { return rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 11)) }

// relayOutageDuration is 5 minutes in the run that writes
// docs/RELIABILITY.md (`make reliability`) and 1 minute otherwise (`make
// test`): the same backlog path, drained at the same rate limit, with a
// fifth of the events. The relay-outage subtests are the suite's longest,
// and at 5 minutes they alone set its duration. MILLRACE_FAULTS_RELAY_OUTAGE
// sets it either way.
func relayOutageDuration() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("MILLRACE_FAULTS_RELAY_OUTAGE")); err == nil {
		return d
	}
	if os.Getenv(reportEnv) != "" {
		return 5 * time.Minute
	}
	return time.Minute
}

// Declared first so that its long, mostly idle subtests start first and the
// other scenarios run beside them.
func TestRelayOutageThenDrain(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		const limit = 1000 // relay.rate_limit for the drain, events/s
		w := newWorld(t, kind, worldOptions{tune: func(c *bus.Config) { c.Relay.RateLimit = limit }})
		w.start("consumer", nodeSpec{Consume: true})
		outage := relayOutageDuration()
		w.flowing(0)
		stop := w.writer.start(100)
		time.Sleep(outage)
		stop()
		w.writer.resolve(t)
		backlog := len(w.writer.committed)
		w.fault()
		began := time.Now()
		w.start("relay", nodeSpec{Relay: true})
		// The relay's own drain: until the outbox has nothing pending.
		oc, err := ops.New(context.Background(), w.db, w.cfg)
		require.NoError(t, err)
		var relayed time.Duration
		testkit.Eventually(t, settleTimeout+outage, "the relay to drain the outbox", func() bool {
			st, err := oc.OutboxStatus(context.Background(), w.cfg.Relay.ConsumerGroup)
			relayed = time.Since(began)
			return err == nil && st.Pending == 0
		})
		relayRate := float64(backlog) / relayed.Seconds()
		// The rate limiter's burst is one batch.
		require.LessOrEqual(t, float64(backlog-w.cfg.Relay.BatchSize)/relayed.Seconds(), float64(limit),
			"the drain kept to relay.rate_limit")
		recovery := w.settle(settleTimeout + outage)
		w.record(result{scenario: relayOutage, broker: kind, faults: fmt.Sprintf("relay down %s", outage), o: w.check(true),
			ordered: true, recovery: recovery, note: fmt.Sprintf("a backlog of %d events: relayed in %s (%.0f events/s, rate_limit %d), "+
				"all effects applied %s after the relay started (one ordered consumer process)",
				backlog, relayed.Round(100*time.Millisecond), relayRate, limit, recovery.Round(100*time.Millisecond))})
	})
}

func TestRelaySIGKILL(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		w := newWorld(t, kind, worldOptions{})
		recovery := killRelays(w)
		w.record(result{scenario: relayKilled, broker: kind, faults: fmt.Sprintf("%d SIGKILLs", relayKills),
			o: w.check(true), ordered: true, recovery: recovery})
	})
}

// relayKills is how many relays killRelays SIGKILLs.
const relayKills = 8

// killRelays runs a consumer and the service at the suite's rate, and
// SIGKILLs relayKills relays one after the other, each 300 to 1500 ms
// after its start; then one runs on until the flow has settled. It
// returns the recovery time.
func killRelays(w *world) time.Duration {
	w.start("consumer", nodeSpec{Consume: true})
	stop := w.writer.start(rate)
	rng := newRand()
	for i := range relayKills {
		relay := w.start(fmt.Sprint("relay-", i), nodeSpec{Relay: true})
		if i == 0 {
			w.flowing(100)
		}
		time.Sleep(time.Duration(300+rng.IntN(1200)) * time.Millisecond)
		relay.kill()
		w.fault()
	}
	stop()
	w.start("relay", nodeSpec{Relay: true})
	return w.settle(settleTimeout)
}

// flowAtRate starts a relay and a consumer, and the service committing at
// the suite's rate, and returns once 200 events had their effect; stop
// stops the service.
func (w *world) flowAtRate() (stop func()) {
	w.start("relay", nodeSpec{Relay: true})
	w.start("consumer", nodeSpec{Consume: true})
	stop = w.writer.start(rate)
	w.flowing(200)
	return stop
}

func TestConsumerSIGKILLAfterEffect(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) { consumerSIGKILL(t, kind, false) })
}

// TestConsumerSIGKILLAfterBatchCommit is TestConsumerSIGKILLAfterEffect
// with unordered consumers, whose batches hold several messages on every
// broker: the kill comes after a batch's COMMIT, before its acks.
func TestConsumerSIGKILLAfterBatchCommit(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) { consumerSIGKILL(t, kind, true) })
}

func consumerSIGKILL(t *testing.T, kind string, unordered bool) {
	w := newWorld(t, kind, worldOptions{unordered: unordered})
	const kills = 3
	recovery := killConsumers(w, kills, nodeSpec{Consume: true})
	if unordered {
		w.record(result{scenario: consumerKilledBatched, broker: kind, faults: fmt.Sprintf("%d SIGKILLs", kills),
			o: w.check(false), recovery: recovery})
		return
	}
	// On NATS the next holder of the ordered group's lease recreates its
	// consumer from the ack floor: what a dead consumer held comes back
	// before anything newer, on every server version.
	w.record(result{scenario: consumerKilled, broker: kind, faults: fmt.Sprintf("%d SIGKILLs", kills),
		o: w.check(true), ordered: true, recovery: recovery})
}

// killConsumers commits 1,500 events and starts the relay, then kills
// consumers: each runs consumer as spec says and SIGKILLs itself after 50 to
// 300 effects, one after the other; then one runs on until the flow has
// settled. It returns the recovery time.
func killConsumers(w *world, kills int, consumer nodeSpec) time.Duration {
	w.t.Helper()
	w.writer.commit(1500)
	w.start("relay", nodeSpec{Relay: true})
	w.killInTurn("consumer", kills, consumer, 50, 250)
	w.start("consumer", consumer)
	return w.settle(settleTimeout)
}

// killInTurn runs kills consumers named name-0, name-1, ... one after the
// other, each as consumer says, SIGKILLing itself after least plus up to
// spread effects of its own, and notes each kill as a fault.
func (w *world) killInTurn(name string, kills int, consumer nodeSpec, least, spread int) {
	t := w.t
	t.Helper()
	rng := newRand()
	for i := range kills {
		spec := consumer
		spec.KillAfterEffect = least + rng.IntN(spread+1)
		c := w.start(fmt.Sprint(name, "-", i), spec)
		select {
		case <-c.proc.Done():
		case <-time.After(2 * time.Minute):
			t.Fatalf("%s %d never reached its kill point", name, i)
		}
		require.True(t, c.proc.KilledBySIGKILL(), "%s %d died by its own SIGKILL, not %v:\n%s", name, i, c.proc.Err(), tail(c.stderr.String(), 2000))
		c.stopped.Store(true)
		w.fault()
	}
}

// TestConsumerSIGKILLWhileRetrying: every 10th event's first attempt
// fails, so the unordered consumers hand it to the broker for its next
// attempt (JetStream NakWithDelay, RabbitMQ's retry queue, Kafka's retry
// topic) while they are SIGKILLed three times: a message parked or being
// parked at a kill is neither lost nor applied twice, and every failed
// event is applied once on a later attempt, none poisoned.
func TestConsumerSIGKILLWhileRetrying(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		const failEvery = 10
		w := newWorld(t, kind, worldOptions{unordered: true, tune: func(cfg *bus.Config) { cfg.Broker.Kafka.RetryTopics = true }})
		const kills = 3
		recovery := killConsumers(w, kills, nodeSpec{Consume: true, FailFirstEvery: failEvery})
		o := w.check(false)
		var failed int
		require.NoError(t, w.db.QueryRow(`SELECT count(*) FROM `+w.table("failed_attempts")).Scan(&failed))
		require.Equal(t, len(w.writer.committed)/failEvery, failed, "every 10th committed event failed its first attempt")
		require.Zero(t, o.poisoned, "one failed attempt poisons nothing")
		atBroker, inProcess := 0, 0
		for _, n := range w.nodes {
			log := n.stderr.String()
			atBroker += strings.Count(log, "the broker delivers the message again after its backoff")
			inProcess += strings.Count(log, "Attempt failed, retrying")
		}
		require.Positive(t, atBroker, "failed attempts were handed to the broker")
		require.Zero(t, inProcess, "no failed attempt waited in a worker")
		w.record(result{scenario: consumerKilledRetrying, broker: kind, faults: fmt.Sprintf("%d SIGKILLs", kills),
			o: o, recovery: recovery, note: fmt.Sprintf("%d events failed their first attempt and were applied on a later one", failed)})
	})
}

// TestConsumerPausedPastFailureDetection freezes the consumer process (a
// long GC pause, a stalled VM) three times, mid-flow, each time for longer
// than the broker waits before it takes the consumer's messages back:
// Kafka's session timeout (the group drops the member), NATS's ack_wait
// (the messages are redelivered), two AMQP heartbeats (RabbitMQ closes the
// connection and requeues what it held). The consumer resumes by itself.
func TestConsumerPausedPastFailureDetection(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		w := newWorld(t, kind, worldOptions{tune: func(c *bus.Config) { c.Broker.RabbitMQ.Heartbeat = 2 * time.Second }})
		w.start("relay", nodeSpec{Relay: true})
		c := w.start("consumer", nodeSpec{Consume: true})
		stop := w.writer.start(rate)
		w.flowing(200)
		pause := w.cfg.Broker.Kafka.SessionTimeout + w.cfg.Broker.NATS.Consumer.AckWait
		const pauses = 3
		for range pauses {
			require.NoError(t, syscall.Kill(c.proc.Pid(), syscall.SIGSTOP))
			time.Sleep(pause)
			require.NoError(t, syscall.Kill(c.proc.Pid(), syscall.SIGCONT))
			w.fault()
			time.Sleep(5 * time.Second)
		}
		stop()
		recovery := w.settle(settleTimeout)
		w.record(result{scenario: consumerPaused, broker: kind, faults: fmt.Sprintf("%d pauses of %s", pauses, pause),
			o: w.check(true), ordered: true, recovery: recovery})
	})
}

func TestBrokerRestart(t *testing.T) {
	eachBroker(t, []string{bus.KindNATS, bus.KindRabbitMQ}, func(t *testing.T, kind string) {
		var url string
		var restart func()
		switch kind {
		case bus.KindNATS:
			s := servers.StartNATS(t)
			url, restart = s.URL, s.Restart
		case bus.KindRabbitMQ:
			s := servers.StartRabbitMQ(t, "", "")
			url, restart = s.URL, s.Restart
		}
		w := newWorld(t, kind, worldOptions{brokerURL: url, unordered: true})
		w.start("relay", nodeSpec{Relay: true})
		w.start("consumer", nodeSpec{Consume: true})
		stop := w.writer.start(rate)
		w.flowing(200)
		began := time.Now()
		restart()
		w.fault()
		down := time.Since(began)
		time.Sleep(5 * time.Second)
		stop()
		recovery := w.settle(settleTimeout)
		// A publish that failed mid-batch is retried after later events of
		// its batch went out: order is not promised here (README).
		w.record(result{scenario: brokerRestarted, broker: kind, faults: "1 restart", o: w.check(false),
			recovery: recovery, note: fmt.Sprintf("the %s server was down for %s", kind, down.Round(100*time.Millisecond))})
	})
}

func TestPostgreSQLRestart(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		pg := servers.StartPostgreSQL(t)
		w := newWorld(t, kind, worldOptions{databaseURL: pg.URL})
		down, recovery := restartPostgreSQL(w, pg)
		w.record(result{scenario: postgresCrashed, broker: kind, faults: "1 crash restart", o: w.check(true), ordered: true,
			recovery: recovery, note: down})
	})
}

// restartPostgreSQL crash-restarts w's private PostgreSQL pg mid-flow and
// returns how long it was down (a note for the report) and the recovery
// time.
func restartPostgreSQL(w *world, pg *servers.PostgreSQL) (string, time.Duration) {
	stop := w.flowAtRate()
	began := time.Now()
	pg.Restart()
	w.fault()
	down := time.Since(began)
	time.Sleep(5 * time.Second)
	stop()
	recovery := w.settle(settleTimeout)
	return fmt.Sprintf("PostgreSQL was down for %s; the service's transactions failed meanwhile (%d)",
		down.Round(100*time.Millisecond), w.writer.failures), recovery
}

func TestSIGTERMMidBatch(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		// The rate limit keeps the relay mid-batch for seconds.
		w := newWorld(t, kind, worldOptions{tune: func(c *bus.Config) { c.Relay.RateLimit = 500; c.Relay.BatchSize = 500 }})
		w.writer.commit(3000)
		n := w.start("node", nodeSpec{Relay: true, Consume: true})
		testkit.Eventually(t, time.Minute, "the node to be busy", func() bool {
			var effects int
			return w.db.QueryRow(`SELECT count(*) FROM `+w.table("effects")).Scan(&effects) == nil && effects >= 300
		})
		// What the configuration allows: the relay's shutdown timeout and
		// the router's close timeout (the longest handler timeout + 10s).
		limit := w.cfg.Relay.ShutdownTimeout + w.cfg.Consumer.HandlerTimeout + 10*time.Second
		took, err := n.term(limit)
		require.NoError(t, err, "the node exits cleanly on SIGTERM:\n%s", tail(n.stderr.String(), 2000))
		w.fault()
		w.start("node-2", nodeSpec{Relay: true, Consume: true})
		recovery := w.settle(settleTimeout)
		w.record(result{scenario: terminated, broker: kind, faults: "1 SIGTERM", o: w.check(true), ordered: true, recovery: recovery,
			note: fmt.Sprintf("exit status 0 %s after SIGTERM (allowed: %s)", took.Round(10*time.Millisecond), limit)})
	})
}

func TestTwoRelaysTwoConsumers(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		// Order is not promised on RabbitMQ here (below): its consumers run
		// unordered, with batches of several messages.
		w := newWorld(t, kind, worldOptions{unordered: kind == bus.KindRabbitMQ})
		a := w.start("a", nodeSpec{Relay: true, Consume: true})
		w.start("b", nodeSpec{Relay: true, Consume: true})
		stop := w.writer.start(rate)
		w.flowing(200)
		a.kill()
		w.fault()
		time.Sleep(time.Second)
		w.start("a-again", nodeSpec{Relay: true, Consume: true})
		time.Sleep(5 * time.Second)
		stop()
		recovery := w.settle(settleTimeout)
		// Order holds per partition on Kafka, and on NATS, where one
		// replica at a time holds the ordered group's lease and its next
		// holder starts from the consumer's ack floor. RabbitMQ replicas
		// compete for one queue, so order there is per process only.
		ordered := kind != bus.KindRabbitMQ
		w.record(result{scenario: twoOfEach, broker: kind, faults: "1 SIGKILL of a node (relay + consumer), restarted 1s later",
			o: w.check(ordered), ordered: ordered, recovery: recovery})
	})
}

func TestPoisonStorm(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		// Parking off: the rest flow past the malformed events (the
		// parked-aggregate scenario parks them).
		w := newWorld(t, kind, worldOptions{tune: func(cfg *bus.Config) { cfg.Consumer.Poison.Park = new(false) }})
		w.writer.poisonEvery = 100
		w.start("node", nodeSpec{Relay: true, Consume: true})
		w.writer.commit(3000)
		w.settle(settleTimeout)
		o := w.check(true)
		require.Positive(t, o.poisoned)
		w.record(result{scenario: poisonStorm, broker: kind, faults: fmt.Sprintf("%d malformed events", o.malformed),
			o: o, ordered: true, note: fmt.Sprintf("%d poisoned, every one malformed; the rest flowed past them (consumer.poison.park: false)", o.poisoned)})
	})
}

func TestDependencyOutage(t *testing.T) {
	eachBroker(t, brokertest.Kinds, func(t *testing.T, kind string) {
		var down atomic.Bool
		var calls, failed atomic.Int64
		dep := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
			calls.Add(1)
			if down.Load() {
				failed.Add(1)
				rw.WriteHeader(http.StatusServiceUnavailable)
			}
		}))
		t.Cleanup(dep.Close)
		// An ordered handler on NATS has one message in flight: its
		// failures alone cannot tell an outage from a bad message
		// (middleware/README.md). Its dependency probe can: with the default
		// retry ladder (5 attempts, about 1.5s) it rides out an outage
		// longer than that. (middleware's
		// TestProbeRidesOutALongOutageBehindAnOrderedHandler holds one for 60s.)
		w := newWorld(t, kind, worldOptions{tune: func(c *bus.Config) { c.Consumer.Retry = middleware.RetryConfig{} }})
		w.start("node", nodeSpec{Relay: true, Consume: true, DependencyURL: dep.URL, Probe: true})
		stop := w.writer.start(rate)
		w.flowing(200)
		const outage = 5 * time.Second
		down.Store(true)
		time.Sleep(outage)
		down.Store(false)
		w.fault()
		time.Sleep(3 * time.Second)
		stop()
		recovery := w.settle(settleTimeout)
		o := w.check(true)
		w.record(result{scenario: dependencyOutage, broker: kind, faults: fmt.Sprintf("%s of HTTP 503", outage), o: o, ordered: true,
			recovery: recovery, note: fmt.Sprintf("%d calls failed during the outage (handler and dependency probe; the open breaker holds messages between probes); %d poisoned; default retry ladder (max_attempts 5)",
				failed.Load(), o.poisoned)})
	})
}

// TestNATSClusterFaults runs the flow on a private 3-node JetStream cluster
// with streams at 3 replicas and hits the node that leads the topic's
// stream: SIGKILL (and a restart), then SIGSTOP past the cluster's failure
// detection (and SIGCONT), then every node restarted one after another.
func TestNATSClusterFaults(t *testing.T) {
	eachBroker(t, []string{bus.KindNATS}, func(t *testing.T, kind string) {
		c := servers.StartNATSCluster(t, 3)
		w := newWorld(t, kind, worldOptions{brokerURL: c.URLs(), unordered: true,
			tune: func(cfg *bus.Config) { cfg.Broker.NATS.Stream.Replicas = 3 }})
		w.start("relay", nodeSpec{Relay: true})
		w.start("consumer", nodeSpec{Consume: true})
		stop := w.writer.start(rate)
		w.flowing(200)
		ctx := context.Background()
		stream := nats.StreamName(w.topic)
		leader := func() int {
			t.Helper()
			var i int
			testkit.Eventually(t, time.Minute, "the stream has a leader", func() bool {
				var err error
				i, err = c.StreamLeader(ctx, stream)
				return err == nil
			})
			return i
		}
		// progress waits for 200 effects more than there are now.

		c.WaitStreamCurrent(ctx, stream)
		killed := leader()
		c.Nodes[killed].Kill()
		w.fault()
		testkit.Eventually(t, time.Minute, "another node leads the stream", func() bool {
			i, err := c.StreamLeader(ctx, stream)
			return err == nil && i != killed
		})
		w.moreEffects(200)
		c.Nodes[killed].Start()
		c.WaitJetStream()

		c.WaitStreamCurrent(ctx, stream) // the restarted node has caught up
		paused := leader()
		c.Nodes[paused].Pause()
		w.fault()
		time.Sleep(15 * time.Second)
		c.Nodes[paused].Resume()
		c.WaitJetStream()
		w.moreEffects(200)

		for _, n := range c.Nodes {
			c.WaitStreamCurrent(ctx, stream)
			n.Restart()
			w.fault()
			c.WaitJetStream()
		}
		w.recordClusterFaults(stop, "streams at replicas 3")
	})
}

// recordClusterFaults ends a clusterFaults scenario: once 200 more events
// had their effect, stop ends the service's writes, the world settles and
// its outcome is recorded, with note on the cluster and the clients' logs.
// A publish that failed during a failover is retried after later events of
// its batch went out (as on a broker restart): order is not promised.
func (w *world) recordClusterFaults(stop func(), note string) {
	w.t.Helper()
	w.moreEffects(200)
	stop()
	recovery := w.settle(settleTimeout)
	w.record(result{scenario: clusterFaults, broker: w.kind, faults: "1 leader SIGKILL, 1 leader SIGSTOP, 3 restarts",
		o: w.check(false), recovery: recovery, note: note + "; the clients were given all three URLs; " + w.clientLogs()})
}

// partitionFor is how long TestNATSClusterPartition keeps the stream
// leader cut off: past JetStream's failure detection (a Raft election
// timeout of 4-9 s, a leader without quorum steps down after 10 s) and the
// clients' (two unanswered pings at broker.nats.ping_interval, 5 s).
const partitionFor = 20 * time.Second

// TestNATSClusterPartition runs the flow on a private 3-node JetStream
// cluster whose third node runs in a network namespace of its own, moves
// the leadership of the topic's stream to that node, and cuts it off the
// network mid-flow (the link of its namespace down: its process runs on,
// its packets are dropped both ways), then heals it. The partition lasts
// partitionFor, or longer: until the other two nodes have elected a leader
// and 200 more effects were applied, so the flow is shown to go on during
// the partition, not only after it.
func TestNATSClusterPartition(t *testing.T) {
	eachBroker(t, []string{bus.KindNATS}, func(t *testing.T, kind string) {
		c := servers.StartNATSClusterPartitionable(t, 3)
		w := newWorld(t, kind, worldOptions{brokerURL: c.URLs(), tune: func(cfg *bus.Config) { cfg.Broker.NATS.Stream.Replicas = 3 }})
		w.start("relay", nodeSpec{Relay: true})
		w.start("consumer", nodeSpec{Consume: true})
		// Half the suite's rate: the ordered group (max_ack_pending 1) drains
		// what piled up during the partition one message at a time, and at
		// the full rate that took 1.5 to 3.5 minutes after the heal on a
		// busy machine (load average 20).
		stop := w.writer.start(rate / 2)
		w.flowing(200)
		ctx := context.Background()
		stream := nats.StreamName(w.topic)

		c.WaitStreamCurrent(ctx, stream)
		require.NoError(t, c.MoveStreamLeader(ctx, stream, c.Isolated))
		w.moreEffects(200) // the flow runs through the leader that is cut off next
		p := w.partition(c.Partition, c.Heal, func() {
			c.WaitJetStream()
			c.WaitStreamCurrent(ctx, stream) // the healed node has caught up
		}, func() bool {
			i, err := c.StreamLeader(ctx, stream)
			return err == nil && i != c.Isolated
		})
		stop()
		recovery := w.settle(settleTimeout)
		// A publish that timed out on the cut-off leader is retried after
		// later events of its batch went out: order is not promised.
		w.record(result{scenario: clusterPartition, broker: kind, faults: fmt.Sprintf("stream leader cut off %s (network namespace, link down)", p.cutFor.Round(100*time.Millisecond)),
			o: w.check(false), recovery: recovery, note: fmt.Sprintf("streams at replicas 3, the leader's node in a network namespace of its own "+
				"joined by a veth pair whose link was taken down; another node led the stream %s after the cut and 200 more effects were applied %s after it, "+
				"during the partition; %s", p.failover.Round(100*time.Millisecond), p.flowed.Round(100*time.Millisecond), w.clientLogs())})
	})
}

// partitioned is what a partition scenario measured: how long after the
// cut another node led, how long until 200 more effects were applied, and
// how long the cut lasted.
type partitioned struct{ failover, flowed, cutFor time.Duration }

// partition cuts the leader's node off (cut), waits until another node
// leads (newLeader) and 200 more effects were applied, keeps the partition
// for partitionFor or that long, whichever is longer, heals it, waits for
// healed, and for 200 more effects.
func (w *world) partition(cut, heal, healed func(), newLeader func() bool) partitioned {
	w.t.Helper()
	cut()
	w.fault()
	began := time.Now()
	var p partitioned
	testkit.Eventually(w.t, time.Minute, "another node to lead", func() bool {
		led := newLeader()
		p.failover = time.Since(began) // once its answer is in
		return led
	})
	w.moreEffects(200) // during the partition, however long that takes
	p.flowed = time.Since(began)
	time.Sleep(partitionFor - p.flowed) // nothing when the flow took longer
	heal()
	p.cutFor = time.Since(began)
	w.fault()
	healed()
	w.moreEffects(200)
	return p
}

// TestRabbitMQClusterFaults runs the flow on a private 3-node RabbitMQ
// cluster, the group's quorum queue with a member on every node, and hits
// the node that leads it: SIGKILL (and a restart), SIGSTOP for 15 s (and
// SIGCONT), then every node restarted one after another. The clients have
// the three nodes' URLs.
func TestRabbitMQClusterFaults(t *testing.T) {
	eachBroker(t, []string{bus.KindRabbitMQ}, func(t *testing.T, kind string) {
		c := servers.StartRabbitMQCluster(t, 3)
		w := newWorld(t, kind, worldOptions{brokerURL: c.URLs(), unordered: true})
		w.start("relay", nodeSpec{Relay: true})
		w.start("consumer", nodeSpec{Consume: true})
		stop := w.writer.start(rate)
		w.flowing(200)
		queue := rabbit.QueueName(w.topic, w.handler)
		all := []int{0, 1, 2}
		leader := func(via ...int) int {
			t.Helper()
			var i int
			testkit.Eventually(t, 2*time.Minute, "the queue has a leader", func() bool {
				i = c.QueueLeader(queue, via...)
				return i >= 0
			})
			return i
		}
		others := func(i int) []int { return slices.DeleteFunc(slices.Clone(all), func(j int) bool { return j == i }) }

		killed := leader(all...)
		c.Nodes[killed].Kill()
		w.fault()
		testkit.Eventually(t, 2*time.Minute, "another member leads the queue", func() bool {
			i := c.QueueLeader(queue, others(killed)...)
			return i >= 0 && i != killed
		})
		w.moreEffects(200)
		c.Nodes[killed].Start()
		c.AwaitQuorumPlusOne(killed)

		paused := leader(all...)
		c.Nodes[paused].Pause()
		w.fault()
		time.Sleep(15 * time.Second)
		c.Nodes[paused].Resume()
		w.moreEffects(200)

		for i, n := range c.Nodes {
			c.AwaitQuorumPlusOne(i)
			n.Restart()
			w.fault()
		}
		w.recordClusterFaults(stop, "a quorum queue with members on the three nodes")
	})
}

// TestRabbitMQClusterPartition runs the flow on a private 3-node RabbitMQ
// cluster whose first node runs in a network namespace of its own and leads
// the group's quorum queue (declared through it; RabbitMQ 3.10 cannot move
// a leader on request, so when an election moved it before the cut the
// result says so), with the relay and the consumer connected to it, and
// cuts that node off the network mid-flow,
// then heals it. The cut-off node pauses itself once it notices
// (pause_minority, 10s ticks), the other two elect a new leader, and the
// clients, whose connections are silently dead, notice by their AMQP
// heartbeats and connect to the next URL. As TestNATSClusterPartition, the
// partition lasts partitionFor or until 200 more effects were applied.
func TestRabbitMQClusterPartition(t *testing.T) {
	eachBroker(t, []string{bus.KindRabbitMQ}, func(t *testing.T, kind string) {
		c := servers.StartRabbitMQClusterPartitionable(t, 3)
		w := newWorld(t, kind, worldOptions{brokerURL: c.URLs(), unordered: true})
		queue := rabbit.QueueName(w.topic, w.handler)
		others := []int{1, 2}
		require.Equal(t, c.Isolated, c.QueueLeader(queue, others...), "the queue is led by the node it was declared on")
		w.start("relay", nodeSpec{Relay: true})
		w.start("consumer", nodeSpec{Consume: true})
		stop := w.writer.start(rate)
		w.flowing(200)

		// The leader may have moved off the node it was declared on (an
		// election on a loaded machine); then the node cut off is a member
		// and the clients' node, and the note says so.
		leader := c.QueueLeader(queue, others...)
		p := w.partition(c.Partition, c.Heal, func() {
			c.AwaitQuorumPlusOne(others[0]) // the healed node is a member again
		}, func() bool {
			i := c.QueueLeader(queue, others...)
			return i >= 0 && i != c.Isolated
		})
		stop()
		recovery := w.settle(settleTimeout)
		cutOff, failover := "queue leader", fmt.Sprintf("another node led the queue %s after the cut", p.failover.Round(100*time.Millisecond))
		if leader != c.Isolated {
			cutOff, failover = "queue member", fmt.Sprintf("the queue's leader had moved to another node (%d) before the cut", leader)
		}
		// A publish whose confirm was lost with the cut-off node is retried
		// after later events of its batch went out: order is not promised.
		w.record(result{scenario: clusterPartition, broker: kind, faults: fmt.Sprintf("%s cut off %s (network namespace, link down)", cutOff, p.cutFor.Round(100*time.Millisecond)),
			o: w.check(false), recovery: recovery, note: fmt.Sprintf("a quorum queue with members on the three nodes, declared through the node in a network namespace "+
				"of its own, which the relay and the consumer were connected to; pause_minority, net_ticktime 10s, AMQP heartbeat 10s; "+
				"%s, and 200 more effects were applied %s after it, during the partition; %s",
				failover, p.flowed.Round(100*time.Millisecond), w.clientLogs())})
	})
}

// TestKafkaClusterFaults runs the flow on a private 3-broker kfake cluster
// and moves what a Kafka cluster moves when a broker fails: the leader of
// the topic's first partition moves to another broker, then every partition
// gets a new leader and every group a new coordinator at once, three times.
// kfake keeps one log in memory for all its brokers, so it cannot model
// replication (acks=all and min.insync.replicas are answered at once, there
// is no unclean election), and removing one of its brokers closes only its
// listener while its open connections are still served, so a dead or hung
// broker is not modelled either. What this scenario checks is the client side
// of a failover: metadata refresh, NOT_LEADER and coordinator errors,
// rejoining groups.
func TestKafkaClusterFaults(t *testing.T) {
	eachBroker(t, []string{bus.KindKafka}, func(t *testing.T, kind string) {
		c, err := kfake.NewCluster(kfake.NumBrokers(3), kfake.ClusterID("millrace-faults"))
		require.NoError(t, err)
		t.Cleanup(c.Close)
		addrs := c.ListenAddrs()
		w := newWorld(t, kind, worldOptions{unordered: true, tune: func(cfg *bus.Config) { cfg.Broker.Kafka.Brokers = addrs }})
		w.start("relay", nodeSpec{Relay: true})
		w.start("consumer", nodeSpec{Consume: true})
		stop := w.writer.start(rate)
		w.flowing(200)

		leader := c.LeaderFor(w.topic, 0)
		require.GreaterOrEqual(t, leader, int32(0), "the topic's first partition has a leader")
		require.NoError(t, c.MoveTopicPartition(w.topic, 0, (leader+1)%3))
		w.fault()
		w.moreEffects(200)
		for range 3 {
			c.ShufflePartitionLeaders()
			c.RehashCoordinators()
			w.fault()
			w.moreEffects(200)
		}
		stop()
		recovery := w.settle(settleTimeout)
		// A publish that failed during a leader move is retried after later
		// events of its batch went out: order is not promised.
		w.record(result{scenario: clusterFaults, broker: kind, faults: "1 leader moved, 3 elections of every leader and coordinator",
			o: w.check(false), recovery: recovery, note: "a kfake cluster of 3 brokers: leader and coordinator moves as clients see them; kfake does not replicate and does not model a dead broker (see TestKafkaClusterFaults); " + w.clientLogs()})
	})
}
