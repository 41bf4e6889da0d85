package forwarder_test

import (
	"bufio"
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
	"github.com/millrace-io/millrace/internal/testing/servers"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/internal/testing/testkit/child"
)

// shardRelay is a relay process of the shard test and where its metrics are.
type shardRelay struct {
	name, addr string
	proc       *child.Process
}

// scrape sums the samples of each metric name the relay serves; nil when it
// does not answer (not started yet, or killed).
func (r *shardRelay) scrape() map[string]float64 {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get("http://" + r.addr + "/metrics")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		name, rest, _ := strings.Cut(line, "{")
		if i := strings.LastIndexByte(rest, ' '); i >= 0 {
			if v, err := strconv.ParseFloat(rest[i+1:], 64); err == nil {
				out[name] += v
			}
		}
	}
	return out
}

// freeAddr is a metrics address for a relay process, below the ephemeral
// range (servers.FreePort): a restarted relay binds it again, and a port of
// that range may meanwhile be the source port of an outgoing connection.
func freeAddr(t *testing.T) string {
	return "127.0.0.1:" + strconv.Itoa(servers.FreePort(t))
}

// Three relay processes on eight shards while 10,000 events of 200
// aggregates are committed: one is killed with SIGKILL, then another, and
// both are restarted. Every committed event reaches the broker, each
// aggregate's events first arrive in commit order, the shards spread over
// the three again, and the unowned-shards gauge rose and is back at 0.
//
// The brokers run one after the other: nine relay processes at once, each
// with a connection per owned shard besides its lock and LISTEN sessions,
// would take most of a default PostgreSQL's 100 connections from the
// tests running beside them.
func TestShardedRelaysSurviveKills(t *testing.T) {
	t.Parallel()
	for _, kind := range brokertest.Kinds {
		t.Run(kind, func(t *testing.T) { testShardedRelaysSurviveKills(t, kind) })
	}
}

func testShardedRelaysSurviveKills(t *testing.T, kind string) {
	const shards, events, aggregates = 8, 10_000, 200
	e := newEndToEnd(t, kind, "shards")
	db, b, cfg, broker, topic, got := e.db, e.bus, e.cfg, e.broker, e.topic, e.got

	prefix := "shard" + cfg.Database.Schema[len(cfg.Database.Schema)-8:]
	relays := make([]*shardRelay, 3)
	for i := range relays {
		relays[i] = &shardRelay{name: prefix + strconv.Itoa(i), addr: freeAddr(t)}
	}
	s := sampleUnowned(t)
	launch := func(r *shardRelay) {
		r.proc = startNamedRelayProcess(t, cfg, "", r.name, childShardsEnv+"="+strconv.Itoa(shards), childMetrics+"="+r.addr)
		s.setLive(r, true)
	}
	// spread says whether every relay in want answers and their shards add
	// up to all of them.
	spread := func(want ...*shardRelay) bool { return shardsSpread(shards, want...) }

	for _, r := range relays {
		launch(r)
	}
	testkit.Eventually(t, waitLimit, "three relays sharing the shards", func() bool { return spread(relays...) })

	written := make(chan *writer, 1)
	go func() {
		w := newWriter()
		w.aggregates = aggregates
		w.write(t, b, db, topic, events)
		written <- w
	}()

	testkit.Eventually(t, waitLimit, "a first part forwarded", func() bool { return got.distinct() > events/5 })
	atStart := s.takeMax() // from here on, what the kills and restarts leave unowned
	s.kill(t, relays[0])
	testkit.Eventually(t, waitLimit, "two relays own every shard", func() bool { return spread(relays[1], relays[2]) })
	testkit.Eventually(t, waitLimit, "a second part forwarded", func() bool { return got.distinct() > events/2 })
	s.kill(t, relays[1])
	testkit.Eventually(t, waitLimit, "the last relay owns every shard", func() bool { return spread(relays[2]) })
	for _, r := range relays[:2] {
		launch(r)
	}
	w := <-written
	testkit.Eventually(t, waitLimit, "every committed event on the broker", func() bool { return got.distinct() >= len(w.committed) })
	testkit.Eventually(t, waitLimit, "the restarted relays take their share again", func() bool { return spread(relays...) })

	f, err := forwarder.New(db, broker, forwarder.Outbox{Schema: cfg.Database.Schema, Topic: cfg.Outbox.Topic}, shardCrashConfig(shards), forwarder.Options{})
	require.NoError(t, err)
	testkit.Eventually(t, waitLimit, "nothing pending in any shard", func() bool { return pending(t, f) == 0 })
	for _, r := range relays {
		require.NoError(t, r.proc.Stop(waitLimit), "%s stops gracefully", r.name)
	}
	afterKills := s.takeMax()
	require.Positive(t, afterKills, "the unowned-shards gauge rose while a killed relay's shards had no owner")

	checkShardedDelivery(t, got, w, aggregates)
	t.Logf("%s: %d committed events, %d deliveries (%d duplicates), unowned shards peaked at %v at start, %v after the kills",
		kind, len(w.committed), got.total, got.total-len(got.count), atStart, afterKills)
}

// unownedSampler follows the highest unowned-shards gauge the live relays
// report.
type unownedSampler struct {
	mu         sync.Mutex
	live       map[*shardRelay]bool
	maxUnowned float64
}

// sampleUnowned scrapes the live relays every 10 ms until the test ends.
func sampleUnowned(t *testing.T) *unownedSampler {
	s := &unownedSampler{live: map[*shardRelay]bool{}}
	sampleCtx, stopSampling := context.WithCancel(context.Background())
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for sampleCtx.Err() == nil {
			s.mu.Lock()
			rs := make([]*shardRelay, 0, len(s.live))
			for r := range s.live {
				rs = append(rs, r)
			}
			s.mu.Unlock()
			for _, r := range rs {
				if m := r.scrape(); m != nil {
					s.mu.Lock()
					s.maxUnowned = max(s.maxUnowned, m["millrace_relay_unowned_shards"])
					s.mu.Unlock()
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	t.Cleanup(func() { stopSampling(); <-sampled })
	return s
}

func (s *unownedSampler) setLive(r *shardRelay, up bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.live[r] = up
}

// takeMax returns the highest gauge seen since the last takeMax and starts
// over.
func (s *unownedSampler) takeMax() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	peak := s.maxUnowned
	s.maxUnowned = 0
	return peak
}

// kill stops sampling r and kills it with SIGKILL.
func (s *unownedSampler) kill(t *testing.T, r *shardRelay) {
	s.setLive(r, false)
	r.proc.Kill()
	<-r.proc.Done()
	require.True(t, r.proc.KilledBySIGKILL(), "%s: %v", r.name, r.proc.Err())
}

// shardsSpread says whether every relay in want answers, owns its share of
// the shards (give or take one) and their shards add up to all of them.
func shardsSpread(shards int, want ...*shardRelay) bool {
	total := 0
	for _, r := range want {
		m := r.scrape()
		if m == nil || m["millrace_relay_unowned_shards"] != 0 {
			return false
		}
		n := int(m["millrace_relay_shard_owned"])
		if n < shards/len(want)-1 { // each owns its share, give or take one
			return false
		}
		total += n
	}
	return total == shards
}

// checkShardedDelivery checks that exactly the events w committed reached
// the broker, each aggregate's in order, and that every aggregate did.
func checkShardedDelivery(t *testing.T, got *collector, w *writer, aggregates int) {
	got.checkDelivery(t, w)
	got.mu.Lock()
	defer got.mu.Unlock()
	require.Len(t, got.order, aggregates)
}
