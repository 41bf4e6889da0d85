package middleware_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/testdb"
	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

// Every event is delivered twice; two consumer groups each get every event.
// Each group must end with exactly one business row and one inbox row per
// event, on every broker.
func TestDuplicateDeliveriesHaveOneEffectPerGroup(t *testing.T) {
	t.Parallel()
	testkit.Each(t, kitNames, func(t *testing.T, name string) {
		const events = 1000
		e := newEnv(t)
		k := newKit(t, name, kitOptions{})
		topic := uniqueName(t, "orders")
		groups := []string{uniqueName(t, "billing"), uniqueName(t, "shipping")}
		k.provision(t, topic, groups...)

		msgs := make([]*message.Message, 0, 2*events)
		for i := range events {
			msg := event(fmt.Sprintf("evt-%04d", i), fmt.Sprintf("order-%d", i%37), int64(i/37+1), `{"n":1}`)
			// The duplicate has the same event id in a new broker message, so
			// that NATS's own deduplication by message id lets it through.
			dup := msg.Copy()
			dup.UUID = msg.UUID + "-again"
			msgs = append(msgs, msg, dup)
		}
		publish(t, k.pub, topic, msgs...)

		var specs []handlerSpec
		for _, g := range groups {
			specs = append(specs, handlerSpec{name: g, topic: topic, group: g, handle: func(msg *message.Message) error {
				return e.write(msg.Context(), g, msg)
			}})
		}
		c := startConsumer(t, k, e, middleware.Config{}, specs...)

		for _, g := range groups {
			// A broker may redeliver more (an ack wait that expired under
			// load); those are duplicates too, never a second effect.
			testkit.Eventually(t, 4*time.Minute, "every delivery of "+g+" acked", func() bool {
				ok := c.messages(t, g, middleware.OutcomeOK)
				dup := c.messages(t, g, middleware.OutcomeDuplicate)
				return ok >= events && dup >= events
			})
		}
		for _, g := range groups {
			require.Equal(t, events, e.rows(t, "business", `consumer_group = $1`, g), "business rows of %s", g)
			require.Equal(t, events, e.count(t, `SELECT count(DISTINCT event_id) FROM `+e.table("business")+` WHERE consumer_group = $1`, g))
			require.Equal(t, events, e.rows(t, "millrace_inbox", `consumer_group = $1`, g), "inbox rows of %s", g)
			require.EqualValues(t, events, c.messages(t, g, middleware.OutcomeOK))
			require.GreaterOrEqual(t, c.messages(t, g, middleware.OutcomeDuplicate), float64(events))
		}
		require.Zero(t, e.rows(t, "millrace_poison", ""))
	})
}

// The ordering guard drops versions older than the applied one, in the inbox
// transaction, and counts them as stale.
func TestOrderingGuardDropsStaleVersions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	k := gochannelKit(t)
	topic, group := uniqueName(t, "orders"), uniqueName(t, "projection")
	cfg := middleware.Config{Workers: 1, Ordered: new(true), OrderingGuard: new(true)}
	// Delivered in this order: version 3 arrives before 2 (a reordering
	// upstream); 2 must be dropped, 4 applied, the unversioned one applied.
	var order []*message.Message
	for _, v := range []int64{1, 3, 2, 4} {
		order = append(order, event(fmt.Sprintf("o1-v%d", v), "o-1", v, `{}`))
	}
	order = append(order, event("o1-unversioned", "o-1", 0, `{}`))
	c := startConsumer(t, k, e, cfg, handlerSpec{name: group, topic: topic, group: group, handle: func(msg *message.Message) error {
		return e.write(msg.Context(), group, msg)
	}})
	for _, m := range order {
		publish(t, k.pub, topic, m) // one at a time: gochannel keeps no order within a call
		testkit.Eventually(t, 30*time.Second, "event "+m.UUID+" handled", func() bool {
			return e.rows(t, "millrace_inbox", `event_id = $1`, m.UUID) == 1
		})
	}
	applied := testdb.Column[int64](t, e.db, `SELECT version FROM `+e.table("business")+` ORDER BY seq`)
	require.Equal(t, []int64{1, 3, 4, 0}, applied)
	require.EqualValues(t, 1, c.messages(t, group, middleware.OutcomeStale))
	require.Equal(t, 5, e.rows(t, "millrace_inbox", ""), "a stale event is still recorded in the inbox")
	var version int64
	require.NoError(t, e.db.QueryRow(`SELECT version FROM `+e.table("millrace_aggregate_versions")+` WHERE consumer_group = $1 AND aggregate_id = 'o-1'`, group).Scan(&version))
	require.EqualValues(t, 4, version)
}

// A replay carries the consumer groups it is for (ReplayGroupsKey); every
// other group's chain acks it without calling the handler and without an
// inbox row or an applied aggregate version, counted as not_targeted. One
// stage does it for every kind of handler: here a plain handler, a batch
// handler with batching on, and an ordered handler with the ordering guard,
// which all receive the same messages (gochannel gives every subscription
// every message).
func TestAReplayReachesOnlyTheGroupsItIsFor(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	k := gochannelKit(t)
	topic := uniqueName(t, "orders")
	billing, ledger, projection := uniqueName(t, "billing"), uniqueName(t, "ledger"), uniqueName(t, "projection")
	cfg := middleware.Config{Handlers: map[string]middleware.Config{
		ledger:     {Batch: middleware.BatchConfig{MaxMessages: 8, MaxWait: 50 * time.Millisecond}},
		projection: {Ordered: new(true), OrderingGuard: new(true)},
	}}
	write := func(group string) func(*message.Message) error {
		return func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }
	}
	c := startConsumer(t, k, e, cfg,
		handlerSpec{name: billing, topic: topic, group: billing, handle: write(billing)},
		handlerSpec{name: ledger, topic: topic, group: ledger, batch: func(ctx context.Context, msgs []*message.Message) error {
			for _, m := range msgs {
				if err := e.write(ctx, ledger, m); err != nil {
					return err
				}
			}
			return nil
		}},
		handlerSpec{name: projection, topic: topic, group: projection, handle: write(projection)})

	forBilling := event("ev-billing", "order-1", 2, `{}`)
	forBilling.Metadata.Set(middleware.ReplayGroupsKey, billing)
	forBoth := event("ev-both", "order-2", 1, `{}`)
	forBoth.Metadata.Set(middleware.ReplayGroupsKey, billing+middleware.ReplayGroupsSeparator+ledger)
	plain := event("ev-plain", "order-1", 3, `{}`)
	publish(t, k.pub, topic, forBilling, forBoth, plain)

	want := map[string][]string{billing: {"ev-billing", "ev-both", "ev-plain"}, ledger: {"ev-both", "ev-plain"}, projection: {"ev-plain"}}
	for group, events := range want {
		testkit.Eventually(t, time.Minute, "every message settled by "+group, func() bool {
			return c.messages(t, group, middleware.OutcomeOK)+c.messages(t, group, middleware.OutcomeNotTargeted) == 3
		})
		require.EqualValues(t, len(events), c.messages(t, group, middleware.OutcomeOK), group)
		require.EqualValues(t, 3-len(events), c.messages(t, group, middleware.OutcomeNotTargeted), group)
		for _, table := range []string{"business", "millrace_inbox"} {
			got := testdb.Column[string](t, e.db, `SELECT event_id FROM `+e.table(table)+` WHERE consumer_group = $1 ORDER BY event_id`, group)
			require.Equal(t, events, got, "%s rows of %s", table, group)
		}
	}
	require.Equal(t, 1, e.rows(t, "millrace_aggregate_versions", `consumer_group = $1 AND event_id = 'ev-plain'`, projection),
		"the ordering guard applied only the event that was for its group")
	require.Equal(t, 1, e.rows(t, "millrace_aggregate_versions", `consumer_group = $1`, projection))
}

// TestBrokerBacklog: every adapter reports a consumer group's backlog (what
// bus.Run exports as millrace_consumer_backlog): N events published and not
// consumed are a backlog of N, and once a consumer has processed them, 0.
func TestBrokerBacklog(t *testing.T) {
	t.Parallel()
	testkit.Each(t, batchBrokers, func(t *testing.T, broker string) {
		const events = 20
		e, k, topic, group := newBilling(t, broker, kitOptions{})
		reporter := k.broker
		require.True(t, reporter.Capabilities().Backlog, "%s reports backlogs", broker)
		backlog := func() int64 {
			parts, err := reporter.Backlog(context.Background(), topic, group)
			require.NoError(t, err)
			var sum int64
			for _, n := range parts {
				sum += n
			}
			return sum
		}
		require.Zero(t, backlog(), "nothing published yet")
		msgs := make([]*message.Message, events)
		for i := range msgs {
			msgs[i] = event(fmt.Sprintf("evt-%d", i), fmt.Sprintf("o-%d", i), 1, `{}`)
		}
		publish(t, k.pub, topic, msgs...)
		testkit.Eventually(t, time.Minute, "a backlog of every event published", func() bool { return backlog() == events })

		startConsumer(t, k, e, middleware.Config{}, handlerSpec{name: "billing", topic: topic, group: group,
			handle: func(msg *message.Message) error { return e.write(msg.Context(), group, msg) }})
		testkit.Eventually(t, time.Minute, "every event processed", func() bool {
			return e.rows(t, "business", "") == events
		})
		testkit.Eventually(t, time.Minute, "no backlog once processed (and, on Kafka, committed)", func() bool { return backlog() == 0 })
	})
}
