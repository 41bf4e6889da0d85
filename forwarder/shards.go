package forwarder

import (
	"context"
	"database/sql"
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

// heartbeatsToLive is how many poll intervals a registry row may go without
// a heartbeat before other relays count its instance as gone (a process
// that is stopped but whose session PostgreSQL still keeps).
const heartbeatsToLive = 10

// start records relay.shards (refusing a change while rows are pending),
// then runs the relay as the whole outbox's leader (one shard) or as the
// owner of a share of the shards.
func (f *Forwarder) start(ctx context.Context) error {
	n := *f.cfg.Shards
	if err := f.tables.RecordShards(ctx, f.db, f.cfg.ConsumerGroup, n); err != nil {
		if errors.Is(err, store.ErrShardsChanged) {
			return fmt.Errorf("relay.shards: %d, but %w; change relay.shards by the procedure in docs/SHARDS.md: "+
				"stop every relay of the outbox (or set relay.enabled: false), wait until `millrace outbox status` shows 0 pending, "+
				"then start them with the new relay.shards", n, err)
		}
		return fmt.Errorf("forwarder: %w", err)
	}
	if n == 1 {
		return f.lead(ctx)
	}
	return f.share(ctx)
}

// shardSet is the shards an instance owns, each forwarded by its own relay
// goroutine.
type shardSet struct {
	mu     sync.Mutex
	relays map[int]*shardRelay
}

// shardRelay forwards one shard until stopped.
type shardRelay struct {
	cancel context.CancelFunc
	done   chan struct{}
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
// registry, and every poll_interval renews its heartbeat, counts the live
// instances and owns ceil(shards / live) of the shards, taking free ones
// (the session advisory lock of each, on one dedicated connection) and
// releasing those above its share once their batch in flight is acked.
// A NOTIFY wakes the relay of the shard it names. It returns when ctx ends
// or the lock or LISTEN connection breaks, releasing every shard.
func (f *Forwarder) share(ctx context.Context) error {
	f.health.set(RoleStandby)
	lockConn, err := f.db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("forwarder: shard lock connection: %w", err)
	}
	defer discard(lockConn)
	listenConn, err := f.db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("forwarder: listen connection: %w", err)
	}
	defer discard(listenConn)
	id := instanceID()
	group := f.cfg.ConsumerGroup
	if err := f.tables.Heartbeat(ctx, lockConn, group, id); err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	defer func() {
		bye, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.cfg.ShutdownTimeout)
		defer cancel()
		_ = f.tables.Unregister(bye, f.db, group, id) // a row left behind is dropped by the next live count
	}()
	f.logger.Info("Relay instance registered", watermill.LogFields{"instance": id, "shards": *f.cfg.Shards})

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	set := &shardSet{relays: map[int]*shardRelay{}}
	defer f.releaseAll(set)
	listenerDone := make(chan error, 1)
	ready := make(chan error, 1)
	go func() { listenerDone <- f.listen(runCtx, listenConn, set.wake, ready) }()
	if err := <-ready; err != nil {
		return err
	}
	var bg sync.WaitGroup
	defer bg.Wait()
	defer stop() // before bg.Wait
	bg.Go(func() { f.refreshShards(runCtx) })

	tick := time.NewTicker(f.cfg.PollInterval)
	defer tick.Stop()
	for {
		if err := f.rebalance(runCtx, lockConn, set, id); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		f.health.beat()
		select {
		case <-ctx.Done():
			return nil
		case err := <-listenerDone:
			return fmt.Errorf("%w: %v", errLeadershipLost, err)
		case <-tick.C:
		}
	}
}

// rebalance renews the heartbeat, then takes or releases shards so that
// this instance owns its share.
func (f *Forwarder) rebalance(ctx context.Context, conn *sql.Conn, set *shardSet, id string) error {
	n, group := *f.cfg.Shards, f.cfg.ConsumerGroup
	if err := f.tables.Heartbeat(ctx, conn, group, id); err != nil {
		return fmt.Errorf("%w: %v", errLeadershipLost, err)
	}
	live, err := f.tables.LiveInstances(ctx, conn, group, heartbeatsToLive*f.cfg.PollInterval)
	if err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	share := (n + max(live, 1) - 1) / max(live, 1)
	owned := set.owned()
	for len(owned) > share {
		i := owned[len(owned)-1]
		owned = owned[:len(owned)-1]
		f.stopShard(set, i)
		if err := f.tables.UnlockShard(ctx, conn, group, i, n); err != nil {
			return fmt.Errorf("%w: %v", errLeadershipLost, err)
		}
		f.logger.Info("Relay released a shard above its share", watermill.LogFields{"shard": i, "share": share, "live": live})
	}
	if len(owned) < share {
		unowned, err := f.tables.UnownedShards(ctx, conn, group, n)
		if err != nil {
			return fmt.Errorf("forwarder: %w", err)
		}
		f.metrics.unowned.Set(float64(unowned))
		// Instances start their search at different shards, so that those
		// starting together rarely race for the same lock.
		first := int(hashOf(id) % uint32(n))
		for k := 0; k < n && unowned > 0 && len(owned) < share; k++ {
			i := (first + k) % n
			if slices.Contains(owned, i) {
				continue
			}
			ok, err := f.tables.TryLockShard(ctx, conn, group, i, n)
			if err != nil {
				return fmt.Errorf("%w: %v", errLeadershipLost, err)
			}
			if !ok {
				continue
			}
			c := store.Cursor{Group: group, Shard: i, Shards: n}
			if err := f.tables.PrepareOffsets(ctx, f.db, c); err != nil {
				_ = f.tables.UnlockShard(ctx, conn, group, i, n)
				return fmt.Errorf("forwarder: %w", err)
			}
			f.startShard(ctx, set, i)
			owned = append(owned, i)
			unowned--
			f.logger.Info("Relay took a shard", watermill.LogFields{"shard": i, "share": share, "live": live})
		}
	}
	active := len(owned) > 0
	if r := f.Status().Role; active && r != RoleActive {
		f.health.set(RoleActive)
		f.metrics.leader.Set(1)
	} else if !active && r != RoleStandby {
		f.health.set(RoleStandby)
		f.metrics.leader.Set(0)
	}
	return nil
}

// startShard starts the relay of shard i.
func (f *Forwarder) startShard(ctx context.Context, set *shardSet, i int) {
	w := f.shardRelay(i)
	ctx, cancel := context.WithCancel(ctx)
	r := &shardRelay{cancel: cancel, done: make(chan struct{}), wake: make(chan struct{}, 1)}
	set.mu.Lock()
	set.relays[i] = r
	set.mu.Unlock()
	f.metrics.shardOwned.WithLabelValues(strconv.Itoa(i)).Set(1)
	go func() {
		defer close(r.done)
		refreshed := make(chan struct{})
		go func() { defer close(refreshed); w.refreshBacklog(ctx) }()
		_ = w.forwardLoop(ctx, r.wake, nil) // returns only when ctx ends
		cancel()
		<-refreshed
		w.dropAhead()
	}()
}

// stopShard stops the relay of shard i and waits until its batch in flight
// is acked (or abandoned after shutdown_timeout); only then may its lock go.
func (f *Forwarder) stopShard(set *shardSet, i int) {
	set.mu.Lock()
	r := set.relays[i]
	delete(set.relays, i)
	set.mu.Unlock()
	if r == nil {
		return
	}
	r.cancel()
	<-r.done
	f.metrics.shardOwned.WithLabelValues(strconv.Itoa(i)).Set(0)
	f.metrics.shardPending.DeleteLabelValues(strconv.Itoa(i))
	f.metrics.shardOldestAge.DeleteLabelValues(strconv.Itoa(i))
}

// releaseAll stops every shard relay; the caller then closes the lock
// connection, which releases the locks.
func (f *Forwarder) releaseAll(set *shardSet) {
	for _, i := range set.owned() {
		f.stopShard(set, i)
	}
	f.metrics.leader.Set(0)
}

// shardRelay returns the relay of shard i: this relay's broker, limiter,
// tracing and counters, with its own position, read-ahead, backlog gauges
// and provisioned topics.
func (f *Forwarder) shardRelay(i int) *Forwarder {
	m := *f.metrics
	label := strconv.Itoa(i)
	m.pending, m.oldestAge = f.metrics.shardPending.WithLabelValues(label), f.metrics.shardOldestAge.WithLabelValues(label)
	return &Forwarder{
		db:            f.db,
		broker:        f.broker,
		cfg:           f.cfg,
		tables:        f.tables,
		cursor:        store.Cursor{Group: f.cfg.ConsumerGroup, Shard: i, Shards: *f.cfg.Shards},
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
