package nats

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/nats-io/nats.go/jetstream"
)

// leaseBucket is the JetStream key-value bucket that holds the lease of
// every ordered consumer group, one key per stream and consumer (leaseKey).
const leaseBucket = "millrace_leases"

// leaseKey is the key of group's lease on topic: the stream and consumer
// names, which hold only letters, digits, '-' and '_', as key-value keys
// may.
func leaseKey(topic, group string) string { return StreamName(topic) + "." + ConsumerName(group) }

// leaseValue is what a lease key holds. An empty Owner is a lease its last
// holder gave up (a stop): the next contender takes it at once. Floor is the
// stream sequence up to which every message was acked, as the holder last
// saw it, in the stream created at StreamCreated: a holder that crashed
// between deleting and recreating the group's consumer leaves the position
// there, and a stream deleted and made again has other positions.
type leaseValue struct {
	Owner         string    `json:"owner"`
	TTLMillis     int64     `json:"ttl_ms"`
	Floor         uint64    `json:"floor"`
	StreamCreated time.Time `json:"stream_created"`
}

// lease is an ordered group's lease held by one subscription. A holder that
// cannot renew it within ttl/2 of its last renewal takes it as lost, and a
// contender takes it over only after seeing the same revision unchanged for
// ttl by its own clock, so the two never both hold it while clocks run at
// the same rate; neither side compares its clock with another host's.
type lease struct {
	kv    jetstream.KeyValue
	key   string
	owner string
	ttl   time.Duration

	mu      sync.Mutex // held across each write, which needs the last revision
	rev     uint64
	floor   uint64
	created time.Time // the stream's, for floor

	// taken is when the lease was taken; renewed, the time after taken
	// when the last write that succeeded was sent (monotonic clock).
	taken    time.Time
	renewed  atomic.Int64
	lost     chan struct{} // closed when the lease is lost
	lostOnce sync.Once
	stop     chan struct{} // closed to stop renewing
	renewing sync.WaitGroup
}

// leases returns the lease bucket, creating it when it is missing.
func (b *Broker) leases(ctx context.Context) (jetstream.KeyValue, error) {
	kv, err := b.js.KeyValue(ctx, leaseBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = b.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket:      leaseBucket,
			Description: "millrace: which process consumes each ordered consumer group",
			History:     1,
			Storage:     jetstream.FileStorage,
			Replicas:    b.cfg.Stream.Replicas,
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = b.js.KeyValue(ctx, leaseBucket) // created meanwhile
		}
	}
	if err != nil {
		return nil, fmt.Errorf("nats: lease bucket %q: %w", leaseBucket, err)
	}
	return kv, nil
}

// acquireLease waits until owner holds the lease key and returns it, with
// its renewal running; it returns ctx's error when ctx ends first.
// Meanwhile it looks at the key every ttl/4: a missing key or one given up
// is taken at once, one whose revision stayed the same for its holder's
// ttl is taken over.
func (b *Broker) acquireLease(ctx context.Context, key, owner string, ttl time.Duration) (*lease, error) {
	poll := ttl / 4
	var (
		kv      jetstream.KeyValue // looked up once, not at every poll
		seenRev uint64
		seenAt  time.Time
	)
	for {
		var l *lease
		opCtx, cancel := context.WithTimeout(ctx, ttl/4)
		var err error
		if kv == nil {
			kv, err = b.leases(opCtx)
		}
		if err == nil {
			l, err = b.tryLease(opCtx, kv, key, owner, ttl, &seenRev, &seenAt)
		}
		cancel()
		if l != nil {
			l.renewing.Go(l.renew)
			return l, nil
		}
		if err != nil && ctx.Err() == nil {
			b.logger.Error("Cannot read or take an ordered group's lease; trying again", err, watermill.LogFields{"key": key})
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(poll):
		}
	}
}

// tryLease is one look at key in kv: it returns the lease when owner took it.
func (b *Broker) tryLease(opCtx context.Context, kv jetstream.KeyValue, key, owner string, ttl time.Duration, seenRev *uint64, seenAt *time.Time) (*lease, error) {
	l := &lease{kv: kv, key: key, owner: owner, ttl: ttl, taken: time.Now(), lost: make(chan struct{}), stop: make(chan struct{})}
	e, err := kv.Get(opCtx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		if l.rev, err = kv.Create(opCtx, key, l.value(owner)); err != nil {
			return nil, ignoreTaken(err)
		}
		return l, nil
	}
	if err != nil {
		return nil, err
	}
	var v leaseValue
	if err := json.Unmarshal(e.Value(), &v); err != nil {
		v = leaseValue{Owner: "unreadable"} // taken over after our ttl, like a silent holder's
	}
	l.floor, l.created = v.Floor, v.StreamCreated
	holderTTL := time.Duration(v.TTLMillis) * time.Millisecond
	if holderTTL <= 0 {
		holderTTL = ttl
	}
	switch {
	case v.Owner == "":
	case e.Revision() != *seenRev:
		*seenRev, *seenAt = e.Revision(), time.Now()
		return nil, nil
	case time.Since(*seenAt) < holderTTL:
		return nil, nil
	default:
		b.logger.Info("Taking over an ordered group's lease its holder stopped renewing", watermill.LogFields{"key": key, "holder": v.Owner})
	}
	if l.rev, err = kv.Update(opCtx, key, l.value(owner), e.Revision()); err != nil {
		return nil, ignoreTaken(err)
	}
	return l, nil
}

// ignoreTaken is nil for the error of a lease write that lost the race to
// another contender, err otherwise.
func ignoreTaken(err error) error {
	if errors.Is(err, jetstream.ErrKeyExists) {
		return nil
	}
	return err
}

func (l *lease) value(owner string) []byte {
	v, _ := json.Marshal(leaseValue{Owner: owner, TTLMillis: l.ttl.Milliseconds(), Floor: l.floor, StreamCreated: l.created})
	return v
}

// write stores the lease with l.floor, as owner ("" gives it up), if no one
// else wrote it since l's last write.
func (l *lease) write(ctx context.Context, owner string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	rev, err := l.kv.Update(ctx, l.key, l.value(owner), l.rev)
	if err != nil {
		return err
	}
	l.rev = rev
	return nil
}

// renew writes the lease every ttl/4 until stopped, and declares it lost
// when another process wrote it or no write succeeded for ttl/2.
func (l *lease) renew() {
	tick := time.NewTicker(l.ttl / 4)
	defer tick.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-l.lost:
			return
		case <-tick.C:
		}
		sent := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), l.ttl/4)
		err := l.write(ctx, l.owner)
		cancel()
		switch {
		case err == nil:
			l.renewed.Store(int64(sent.Sub(l.taken)))
		case errors.Is(err, jetstream.ErrKeyExists) || !l.fresh():
			l.markLost()
			return
		}
	}
}

// fresh reports whether the last renewal is recent enough (ttl/2) for the
// holder to hand messages out: a process paused past that, or cut off from
// the server, stops before anyone can have taken the lease over, without
// waiting for its next renewal to fail.
func (l *lease) fresh() bool {
	renewed := l.taken.Add(time.Duration(l.renewed.Load())) // the write that took it was sent earlier still
	return time.Since(renewed) <= l.ttl/2
}

func (l *lease) markLost() { l.lostOnce.Do(func() { close(l.lost) }) }

// floorIn is the floor the lease holds for the stream created at created,
// 0 when it holds one of another stream.
func (l *lease) floorIn(created time.Time) uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.created.Equal(created) {
		return 0
	}
	return l.floor
}

// setFloor records floor, of the stream created at created, in the lease
// before the group's consumer is recreated from it.
func (l *lease) setFloor(ctx context.Context, floor uint64, created time.Time) error {
	l.mu.Lock()
	l.floor, l.created = floor, created
	l.mu.Unlock()
	if err := l.write(ctx, l.owner); err != nil {
		l.markLost()
		return err
	}
	return nil
}

// release stops renewing and, unless the lease was lost, gives it up, so
// the next contender takes it at once.
func (l *lease) release() {
	close(l.stop)
	l.renewing.Wait()
	select {
	case <-l.lost:
		return
	default:
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.ttl/4)
	defer cancel()
	_ = l.write(ctx, "") // not given up: taken over after ttl
	l.markLost()
}

// forgetLeases deletes the lease keys of topic's groups.
func (b *Broker) forgetLeases(ctx context.Context, topic string, groups []string) error {
	if len(groups) == 0 {
		return nil
	}
	s, err := b.js.Stream(ctx, "KV_"+leaseBucket)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("nats: lease bucket %q: %w", leaseBucket, err)
	}
	for _, g := range groups {
		subject := "$KV." + leaseBucket + "." + leaseKey(topic, g)
		if err := s.Purge(ctx, jetstream.WithPurgeSubject(subject)); err != nil {
			return fmt.Errorf("nats: deleting the lease of group %q of topic %q: %w", g, topic, err)
		}
	}
	return nil
}
