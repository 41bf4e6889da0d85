package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testing/testkit"
	"github.com/millrace-io/millrace/middleware"
)

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
			var got []string
			rows, err := e.db.Query(`SELECT event_id FROM `+e.table(table)+` WHERE consumer_group = $1 ORDER BY event_id`, group)
			require.NoError(t, err)
			for rows.Next() {
				var id string
				require.NoError(t, rows.Scan(&id))
				got = append(got, id)
			}
			require.NoError(t, rows.Err())
			require.Equal(t, events, got, "%s rows of %s", table, group)
		}
	}
	require.Equal(t, 1, e.rows(t, "millrace_aggregate_versions", `consumer_group = $1 AND event_id = 'ev-plain'`, projection),
		"the ordering guard applied only the event that was for its group")
	require.Equal(t, 1, e.rows(t, "millrace_aggregate_versions", `consumer_group = $1`, projection))
}
