package middleware

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millrace-io/millrace/internal/envelope"
	"github.com/millrace-io/millrace/internal/sleep"
	"github.com/millrace-io/millrace/internal/store"
)

// OutcomeParked counts a message of a parked order key: recorded in the
// parked table and acked, not handled (consumer.poison.park).
const OutcomeParked = "parked"

// OutcomeSkipped counts a redelivery of a message an operator skipped
// (`millrace dlq skip`), whose ack a crash lost: acked, not handled.
const OutcomeSkipped = "skipped"

// MetricParkedAggregates is the gauge of parked order keys per handler.
const MetricParkedAggregates = "millrace_consumer_parked_aggregates"

// Park timings. A lease outlives its holder by at most parkLease (a
// consumer killed while draining a park), so a survivor or a restarted
// consumer takes the park over within that; the holder renews it every
// parkLease/3 while a message is in the chain. parkPoll is how often a
// consumer looks for released parks and refreshes the gauge.
const (
	parkLease = 5 * time.Second
	parkPoll  = 500 * time.Millisecond
)

// park is the stage that holds the messages of a parked order key: when
// the key is parked (its poisoned message waits for replay or skip, or it
// drains), the message is appended to the key's parked list, under the
// park row's lock, and acked without running the rest of the chain. A
// redelivery of a message an operator skipped is acked too, and dropped.
// A message the park's drain hands on (parkedSource) passes.
func (c *Chain) park(next step) step {
	return func(m *inflight) error {
		msg := m.msg
		if _, drained := c.drained.Load(msg); drained {
			return next(m)
		}
		did, err := c.stack.tables.AppendParked(msg.Context(), c.stack.db, c.parkKey(msg),
			store.ParkedMessage{MessageID: msg.UUID, Payload: msg.Payload, Metadata: msg.Metadata})
		switch {
		case err != nil:
			return fmt.Errorf("millrace consumer: check the park of the message's aggregate: %w", err)
		case did == store.Parked:
			m.d.outcome = OutcomeParked
			return nil
		case did == store.SkippedMessage:
			m.d.outcome = OutcomeSkipped
			return nil
		}
		return next(m)
	}
}

// parkKey is the park msg belongs to: its handler, group and order key
// (Handler.OrderKey, else the aggregate), as the Dispatcher orders it.
func (c *Chain) parkKey(msg *message.Message) store.ParkKey {
	return store.ParkKey{Group: c.spec.ConsumerGroup, Handler: c.spec.Name, Key: c.OrderKey(msg)}
}

// savePoisoned stores p, the poison row of msg, and with consumer.poison.park
// parks msg's order key behind it in the same transaction.
func (c *Chain) savePoisoned(ctx context.Context, msg *message.Message, p store.Poisoned) error {
	t, db := c.stack.tables, c.stack.db
	if !c.cfg.Parks() {
		return t.StorePoisoned(ctx, db, p)
	}
	meta := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		meta[k] = v
	}
	for _, k := range watermillPoisonKeys {
		delete(meta, k)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // a no-op after Commit
	err = t.StorePoisonedParked(ctx, tx, p, c.parkKey(msg), store.ParkedMessage{MessageID: msg.UUID, Payload: msg.Payload, Metadata: meta})
	if err != nil {
		return err
	}
	return tx.Commit()
}

// OrderKey is the key an ordered handler keeps the order of for msg:
// Handler.OrderKey's, else the aggregate-id header. The Dispatcher orders
// by it, and a park is of one.
func (c *Chain) OrderKey(msg *message.Message) string {
	if c.spec.OrderKey != nil {
		if k := c.spec.OrderKey(msg); k != "" {
			return k
		}
	}
	return msg.Metadata.Get(envelope.AggregateIDKey)
}

// Parked returns the constructor of the runtime's input of parked
// messages, the drain of the handler's released parks (consumer.Source's
// Parked), or nil when the handler does not park (consumer.poison.park).
func (c *Chain) Parked() func() (message.Subscriber, error) {
	if !c.cfg.Parks() {
		return nil
	}
	return c.parkedSubscriber
}

// parkedSubscriber is the Dispatcher's input of parked messages (see
// Chain.Parked).
func (c *Chain) parkedSubscriber() (message.Subscriber, error) {
	host, _ := os.Hostname()
	return &parkedSource{c: c, owner: fmt.Sprintf("%s/%d/%s", host, os.Getpid(), watermill.NewShortUUID())}, nil
}

// parkedSource drains the released parks of its handler's group: it takes
// a lease of each (so competing consumers and a restarted one never drain
// one park at once) and hands its messages on, one at a time and in list
// order, through the Dispatcher to the whole chain. A message acked is
// deleted from the list (the inbox absorbs the handling of one whose
// delete a crash lost); one nacked is handed on again; one poisoned again
// parks the key again and ends the drain. The last message gone, the park
// is deleted under its row lock, so a message appended meanwhile is
// drained too. A message of the key that arrives live meanwhile is
// appended to the list by the park stage.
type parkedSource struct {
	c     *Chain
	owner string
	out   chan *message.Message
	stop  context.CancelFunc
	wg    sync.WaitGroup
}

// Subscribe starts the drain; the channel closes after Close.
func (p *parkedSource) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	ctx, p.stop = context.WithCancel(ctx)
	p.out = make(chan *message.Message)
	p.wg.Add(1)
	go p.run(ctx)
	go func() {
		p.wg.Wait()
		close(p.out)
	}()
	return p.out, nil
}

// Close stops the drain; it does not wait, so that a reader still
// draining the channel ends it.
func (p *parkedSource) Close() error {
	if p.stop != nil {
		p.stop()
	}
	return nil
}

// run claims released parks as keys free up and refreshes the gauge,
// until ctx ends; then it waits for its keys and gives up their leases.
func (p *parkedSource) run(ctx context.Context) {
	defer p.wg.Done()
	c := p.c
	active := map[string]bool{}
	done := make(chan string)
	tick := time.NewTicker(parkPoll)
	defer tick.Stop()
	for {
		if free := c.cfg.Workers - len(active); free > 0 {
			keys, err := c.stack.tables.ClaimParks(ctx, c.stack.db, c.spec.ConsumerGroup, c.spec.Name, p.owner, parkLease, free)
			if err != nil && ctx.Err() == nil {
				c.stack.logger.Error("Cannot claim released parks", err, watermill.LogFields{"handler": c.spec.Name})
			}
			for _, k := range keys {
				if !active[k] {
					active[k] = true
					p.wg.Add(1)
					go p.drain(ctx, store.ParkKey{Group: c.spec.ConsumerGroup, Handler: c.spec.Name, Key: k}, done)
				}
			}
		}
		if n, err := c.stack.tables.CountParks(ctx, c.stack.db, c.spec.ConsumerGroup, c.spec.Name); err == nil {
			c.parkedGauge.Set(float64(n))
		}
		select {
		case k := <-done:
			delete(active, k)
		case <-tick.C:
		case <-ctx.Done():
			for len(active) > 0 {
				delete(active, <-done)
			}
			bg, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = c.stack.tables.DropLeases(bg, c.stack.db, c.spec.ConsumerGroup, c.spec.Name, p.owner)
			cancel()
			return
		}
	}
}

// drain hands k's parked messages on while this source holds k's lease.
func (p *parkedSource) drain(ctx context.Context, k store.ParkKey, done chan<- string) {
	defer p.wg.Done()
	defer func() { done <- k.Key }()
	c := p.c
	t, db := c.stack.tables, c.stack.db
	for ctx.Err() == nil {
		m, owned, err := t.NextParked(ctx, db, k, p.owner, parkLease)
		switch {
		case err != nil:
			p.pause(ctx, "Cannot read a released park", err, k)
			continue
		case !owned:
			return
		case m == nil:
			finished, err := t.FinishPark(ctx, db, k, p.owner)
			if err != nil {
				p.pause(ctx, "Cannot finish a drained park", err, k)
				continue
			}
			if finished {
				return
			}
			continue
		}
		if !p.handOn(ctx, k, m) {
			sleep.For(ctx, parkPoll) // nacked: hand it on again after a pause
		}
	}
}

// handOn hands m on and waits for its ack, renewing the lease; an acked
// m is deleted from the list. It reports whether m was acked.
func (p *parkedSource) handOn(ctx context.Context, k store.ParkKey, m *store.ParkedMessage) bool {
	c := p.c
	msg := message.NewMessage(m.MessageID, m.Payload)
	msg.Metadata = m.Metadata
	c.drained.Store(msg, struct{}{})
	defer c.drained.Delete(msg)
	select {
	case p.out <- msg:
	case <-ctx.Done():
		return false
	}
	renew := time.NewTicker(parkLease / 3)
	defer renew.Stop()
	for {
		select {
		case <-msg.Acked():
			// On a context a stop does not end: the ack is given.
			if err := c.stack.tables.DoneParked(context.WithoutCancel(ctx), c.stack.db, m.ID); err != nil {
				c.stack.logger.Error("Cannot delete a handled parked message; it is handed on again and the inbox absorbs it", err,
					watermill.LogFields{"handler": c.spec.Name, "order_key": k.Key, "message_id": m.MessageID})
			}
			return true
		case <-msg.Nacked():
			return false
		case <-renew.C:
			_, _, _ = c.stack.tables.NextParked(ctx, c.stack.db, k, p.owner, parkLease)
		case <-ctx.Done():
			return false
		}
	}
}

// pause logs err and waits a poll interval.
func (p *parkedSource) pause(ctx context.Context, msg string, err error, k store.ParkKey) {
	if ctx.Err() == nil {
		p.c.stack.logger.Error(msg, err, watermill.LogFields{"handler": p.c.spec.Name, "order_key": k.Key})
	}
	sleep.For(ctx, parkPoll)
}

// parkTables are the tables Stack.Check requires for parking.
func parkTables(t store.Tables) []string { return []string{t.ParksTable(), t.ParkedTable()} }
