package forwarder

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millrace-io/millrace/internal/store"
)

// ErrShardsChanged is returned by Run when relay.shards differs from the
// shard count the outbox's pending rows were written with; the message
// names the key and the procedure that changes it.
var ErrShardsChanged = store.ErrShardsChanged

// ErrBrokerChanged is returned by Run when the outbox holds rows written by
// services of another broker.kind than the relay's: at start, while rows
// are pending under the kind the outbox records, or at the first row
// stamped with another kind. The message names both kinds and the
// procedure that switches brokers.
var ErrBrokerChanged = store.ErrBrokerChanged

// switchBrokers is the procedure the errors of a broker change point to.
const switchBrokers = "switch brokers by the procedure in the README (Switching brokers): " +
	"stop the publishers, let the relays of the old broker.kind drain the outbox (`millrace outbox status` shows 0 pending), " +
	"stop them, then start the relays and services with the new broker.kind"

// start records relay.shards (refusing a change while rows are pending),
// LISTENs (or polls), then runs the relay as the whole outbox's leader (one
// shard) or as the owner of a share of the shards.
func (f *Forwarder) start(ctx context.Context) error {
	if f.kind != "" {
		was, err := f.tables.RecordBroker(ctx, f.db, f.kind, f.cursors())
		if err != nil {
			if errors.Is(err, store.ErrBrokerChanged) {
				return fmt.Errorf("broker.kind: %w; %s", err, switchBrokers)
			}
			return fmt.Errorf("forwarder: %w", err)
		}
		if was != "" && was != f.kind {
			f.logger.Info("The outbox is now relayed to another broker.kind", watermill.LogFields{"was": was, "now": f.kind})
		}
	}
	n := f.cfg.OutboxShards()
	if err := f.tables.RecordShards(ctx, f.db, f.cfg.ConsumerGroup, n); err != nil {
		if errors.Is(err, store.ErrShardsChanged) {
			return fmt.Errorf("%s, but %w; change it by the procedure in docs/SHARDS.md: "+
				"stop every relay of the outbox (or set relay.enabled: false), wait until `millrace outbox status` shows 0 pending, "+
				"then start them with the new relay.shards or relay.source", f.shardsSetting(), err)
		}
		return fmt.Errorf("forwarder: %w", err)
	}
	notes, err := f.openNotifier(ctx)
	if err != nil {
		return err
	}
	defer notes.close()
	if n == 1 {
		return f.lead(ctx, notes)
	}
	return f.share(ctx, notes)
}

// shardsSetting names the setting that makes the outbox's shard count.
func (f *Forwarder) shardsSetting() string {
	if f.cfg.Source == SourceWAL {
		return "relay.source: wal writes the outbox as 1 shard"
	}
	return fmt.Sprintf("relay.shards: %d", *f.cfg.Shards)
}

// shardSet is the shards an instance owns, each forwarded by its own relay
// goroutine.
type shardSet struct {
	mu     sync.Mutex
	relays map[int]*shardRelay
}

// shardRelay forwards one shard until stopped.
type shardRelay struct {
	relay  *Forwarder
	cancel context.CancelFunc
	done   chan struct{} // closed when it stopped: cancelled, or its lease lost
	wake   chan struct{}
}

// owned returns the owned shards, sorted.
func (s *shardSet) owned() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]int, 0, len(s.relays))
	for i := range s.relays {
		out = append(out, i)
	}
	slices.Sort(out)
	return out
}

// stopped returns the shards whose relay stopped by itself (its lease lost
// at an ack).
func (s *shardSet) stopped() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []int
	for i, r := range s.relays {
		select {
		case <-r.done:
			out = append(out, i)
		default:
		}
	}
	return out
}

// leases returns the leases of the shards held.
func (s *shardSet) leases() []store.Lease {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]store.Lease, 0, len(s.relays))
	for _, r := range s.relays {
		out = append(out, r.relay.lease)
	}
	return out
}

// wake passes a notification to the relay of shard, or to every shard
// relay when shard is -1; a shard this instance does not own is ignored.
func (s *shardSet) wake(shard int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if shard >= 0 {
		if r := s.relays[shard]; r != nil {
			signal(r.wake)
		}
		return
	}
	for _, r := range s.relays {
		signal(r.wake)
	}
}

// share runs an instance of a sharded relay: it registers in the relay
// registry, and every tick (poll_interval, at most a third of lease_ttl)
// renews its heartbeat and its shard leases, counts the live instances and
// holds ceil(shards / live) of the shards, taking free ones and releasing
// those above its share once their batch in flight is acked. A NOTIFY
// wakes the relay of the shard it names. It returns when ctx ends or the
// LISTEN connection breaks, releasing every shard.
func (f *Forwarder) share(ctx context.Context, notes *notifier) error {
	f.health.set(RoleStandby)
	group := f.cfg.ConsumerGroup
	if err := f.tables.Heartbeat(ctx, f.db, group, f.instance, notes.session); err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	defer func() {
		bye, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.cfg.ShutdownTimeout)
		defer cancel()
		_ = f.tables.Unregister(bye, f.db, group, f.instance) // a row left behind is dropped by the next live count
	}()
	f.logger.Info("Relay instance registered", watermill.LogFields{"instance": f.instance, "shards": *f.cfg.Shards, "listening": notes.listening()})

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	set := &shardSet{relays: map[int]*shardRelay{}}
	defer f.releaseAll(ctx, set)
	notes.setRoute(set.wake)
	defer notes.setRoute(nil)
	var bg sync.WaitGroup
	defer bg.Wait()
	defer stop() // before bg.Wait
	bg.Go(func() { f.refreshShards(runCtx) })

	tick := time.NewTicker(min(f.cfg.PollInterval, f.renewEvery()))
	defer tick.Stop()
	renewed := time.Now()
	for {
		if err := f.rebalance(runCtx, set, notes.session, &renewed); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		f.health.beat()
		select {
		case <-ctx.Done():
			return nil
		case <-notes.lost:
			return fmt.Errorf("%w: the LISTEN connection ended", errLeadershipLost)
		case <-notes.released:
		case <-tick.C:
		}
	}
}

// rebalance renews the heartbeat and the leases held, then takes or
// releases shards so that this instance holds its share.
func (f *Forwarder) rebalance(ctx context.Context, set *shardSet, session *store.Session, renewed *time.Time) error {
	n, group := *f.cfg.Shards, f.cfg.ConsumerGroup
	if err := f.tables.Heartbeat(ctx, f.db, group, f.instance, session); err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	if err := f.renewShards(ctx, set, renewed); err != nil {
		return err
	}
	live, err := f.tables.LiveInstances(ctx, f.db, group, f.cfg.LeaseTTL)
	if err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	share := (n + max(live, 1) - 1) / max(live, 1)
	owned := set.owned()
	for len(owned) > share {
		i := owned[len(owned)-1]
		owned = owned[:len(owned)-1]
		if r := f.stopShard(set, i); r != nil {
			f.release(ctx, r.lease)
		}
		f.logger.Info("Relay released a shard above its share", watermill.LogFields{"shard": i, "share": share, "live": live})
	}
	if len(owned) < share {
		if err := f.takeShards(ctx, set, session, share, live); err != nil {
			return err
		}
	}
	active := len(set.owned()) > 0
	if r := f.Status().Role; active && r != RoleActive {
		f.health.set(RoleActive)
		f.metrics.leader.Set(1)
	} else if !active && r != RoleStandby {
		f.health.set(RoleStandby)
		f.metrics.leader.Set(0)
	}
	return nil
}

// renewShards renews the leases of the shards held, stops the relays of
// those lost (to another relay, or expired while the database did not
// answer for lease_ttl) and forgets those whose relay stopped by itself.
func (f *Forwarder) renewShards(ctx context.Context, set *shardSet, renewed *time.Time) error {
	for _, i := range set.stopped() {
		f.stopShard(set, i)
	}
	leases := set.leases()
	began := time.Now()
	lost, err := f.tables.RenewLeases(ctx, f.db, leases, f.cfg.LeaseTTL)
	switch {
	case err == nil:
		*renewed = began
		f.health.setRenewed(began)
	case time.Since(*renewed) >= f.cfg.LeaseTTL:
		lost = leases
	default:
		return fmt.Errorf("forwarder: %w", err)
	}
	for _, l := range lost {
		f.stopShard(set, l.Cursor.Shard)
		f.logger.Info("Relay lost the lease of a shard", watermill.LogFields{"shard": l.Cursor.Shard})
	}
	return nil
}

// takeShards takes free shards until this instance holds share of them.
// Instances start their search at different shards, so that those starting
// together rarely race for the same lease.
func (f *Forwarder) takeShards(ctx context.Context, set *shardSet, session *store.Session, share, live int) error {
	n, group := *f.cfg.Shards, f.cfg.ConsumerGroup
	unowned, err := f.tables.UnownedShards(ctx, f.db, group, n)
	if err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	f.metrics.unowned.Set(float64(unowned))
	owned := set.owned()
	first := int(hashOf(f.instance) % uint32(n))
	for k := 0; k < n && unowned > 0 && len(owned) < share; k++ {
		i := (first + k) % n
		if slices.Contains(owned, i) {
			continue
		}
		c := store.Cursor{Group: group, Shard: i, Shards: n}
		if err := f.tables.PrepareCursor(ctx, f.db, c); err != nil {
			return fmt.Errorf("forwarder: %w", err)
		}
		lease, pos, ok, err := f.tables.AcquireLease(ctx, f.db, c, f.instance, f.cfg.LeaseTTL, session)
		if err != nil {
			return fmt.Errorf("forwarder: %w", err)
		}
		if !ok {
			continue
		}
		f.startShard(ctx, set, i, lease, pos)
		owned = append(owned, i)
		unowned--
		f.logger.Info("Relay took a shard", watermill.LogFields{"shard": i, "share": share, "live": live, "fence": lease.Fence})
	}
	return nil
}

// startShard starts the relay of shard i, which holds lease at pos.
func (f *Forwarder) startShard(ctx context.Context, set *shardSet, i int, lease store.Lease, pos store.Position) {
	w := f.shardRelay(i)
	w.lease, w.pos, w.saved, w.savedAt = lease, pos, pos, time.Now()
	ctx, cancel := context.WithCancel(ctx)
	r := &shardRelay{relay: w, cancel: cancel, done: make(chan struct{}), wake: make(chan struct{}, 1)}
	set.mu.Lock()
	set.relays[i] = r
	set.mu.Unlock()
	f.metrics.shardOwned.WithLabelValues(strconv.Itoa(i)).Set(1)
	go func() {
		defer close(r.done)
		refreshed := make(chan struct{})
		go func() { defer close(refreshed); w.refreshBacklog(ctx) }()
		if err := w.forwardLoop(ctx, r.wake, nil); err != nil {
			w.logger.Info("Shard relay stopped", watermill.LogFields{"reason": err.Error()})
		}
		cancel()
		<-refreshed
		w.dropAhead()
	}()
}

// stopShard stops the relay of shard i and waits until its batch in flight
// is acked (or abandoned after shutdown_timeout); only then may its lease
// go. It returns the stopped relay, nil when the shard was not held.
func (f *Forwarder) stopShard(set *shardSet, i int) *Forwarder {
	set.mu.Lock()
	r := set.relays[i]
	delete(set.relays, i)
	set.mu.Unlock()
	if r == nil {
		return nil
	}
	r.cancel()
	<-r.done
	f.metrics.shardOwned.WithLabelValues(strconv.Itoa(i)).Set(0)
	f.metrics.shardPending.DeleteLabelValues(strconv.Itoa(i))
	f.metrics.shardOldestAge.DeleteLabelValues(strconv.Itoa(i))
	return r.relay
}

// releaseAll stops every shard relay and releases its lease.
func (f *Forwarder) releaseAll(ctx context.Context, set *shardSet) {
	for _, i := range set.owned() {
		if r := f.stopShard(set, i); r != nil {
			f.release(ctx, r.lease)
		}
	}
	f.metrics.leader.Set(0)
}

// shardRelay returns the relay of shard i: this relay's broker, limiter,
// tracing and counters, with its own lease, position, read-ahead, backlog
// gauges and provisioned topics.
func (f *Forwarder) shardRelay(i int) *Forwarder {
	m := *f.metrics
	label := strconv.Itoa(i)
	m.pending, m.oldestAge = f.metrics.shardPending.WithLabelValues(label), f.metrics.shardOldestAge.WithLabelValues(label)
	return &Forwarder{
		db:            f.db,
		listenDB:      f.listenDB,
		broker:        f.broker,
		cfg:           f.cfg,
		tables:        f.tables,
		cursor:        store.Cursor{Group: f.cfg.ConsumerGroup, Shard: i, Shards: *f.cfg.Shards},
		instance:      f.instance,
		logger:        f.logger.With(watermill.LogFields{"shard": i}),
		metrics:       &m,
		limiter:       f.limiter,
		slice:         f.slice,
		provisioned:   map[string]bool{},
		health:        f.health,
		tracing:       f.tracing,
		beforePublish: f.beforePublish,
		afterPublish:  f.afterPublish,
	}
}

// refreshShards measures the whole outbox's backlog (every shard) and the
// shards no relay owns, at once and then every backlog_interval, for the
// pending, oldest-age and unowned-shards gauges.
func (f *Forwarder) refreshShards(ctx context.Context) {
	t := time.NewTicker(f.cfg.BacklogInterval)
	defer t.Stop()
	for {
		now := time.Now()
		pending, oldest, err := f.Pending(ctx)
		if err == nil {
			f.setBacklog(now, pending, oldest)
			var unowned int
			if unowned, err = f.tables.UnownedShards(ctx, f.db, f.cfg.ConsumerGroup, *f.cfg.Shards); err == nil {
				f.metrics.unowned.Set(float64(unowned))
			}
		}
		if err != nil && ctx.Err() == nil {
			f.logger.Error("Could not measure the outbox backlog and shard owners", err, nil)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// instanceID names this relay instance in the registry: host, process and
// a random part, so that instances of one process are told apart.
func instanceID() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), watermill.NewShortUUID()[:8])
}

func hashOf(s string) uint32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return h.Sum32()
}
