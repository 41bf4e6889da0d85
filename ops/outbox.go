package ops

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/millrace-io/millrace/forwarder"
	"github.com/millrace-io/millrace/internal/names"
	"github.com/millrace-io/millrace/internal/store"
)

// OutboxStatus is the state of the outbox as one relay consumer group sees it.
type OutboxStatus struct {
	// RelayGroup is the relay consumer group (relay.consumer_group).
	RelayGroup string `json:"relay_group"`
	// Pending counts committed rows not forwarded yet.
	Pending int64 `json:"pending"`
	// OldestPendingAge is the age of the oldest pending row.
	OldestPendingAge time.Duration `json:"oldest_pending_age_ns"`
	// LastForwardedAt is when the last forwarded row was written, if it is
	// still in the table; zero otherwise.
	LastForwardedAt time.Time `json:"last_forwarded_at,omitzero"`
	// Forwarded counts forwarded rows still in the table (kept for relay.retention).
	Forwarded int64 `json:"forwarded_retained"`
	// Quarantined counts rows in the relay quarantine.
	Quarantined int64 `json:"quarantined"`
	// Shards is the number of shards the outbox is split into (relay.shards,
	// as the outbox recorded it).
	Shards int `json:"shards"`
	// ShardStates lists each shard's owner and backlog when Shards > 1.
	ShardStates []ShardState `json:"shard_states,omitempty"`
	// Broker is the broker.kind the outbox is relayed to, as its relays
	// recorded it; "" before a relay of this version ran.
	Broker string `json:"broker,omitempty"`
	// Waits lists the transactions whose locks statements of the outbox's
	// relays have waited for a second or longer, longest first: the relay
	// waits for no transaction's commit, only for locks (an operator's
	// SELECT FOR UPDATE on its cursor, a migration's lock on the outbox).
	Waits []forwarder.Wait `json:"waits,omitempty"`
}

// ShardState is one shard of the outbox as one relay consumer group sees it.
type ShardState struct {
	// Shard is the shard's number, from 0.
	Shard int `json:"shard"`
	// Owner is the instance id of the relay that owns the shard; "" when no
	// relay does (none running, or a takeover under way).
	Owner string `json:"owner"`
	// Pending counts the shard's committed rows not forwarded yet.
	Pending int64 `json:"pending"`
	// OldestPendingAge is the age of the shard's oldest pending row.
	OldestPendingAge time.Duration `json:"oldest_pending_age_ns"`
}

// OutboxStatus reads the outbox's state for the relay consumer group
// relayGroup ("" means relay.consumer_group).
func (c *Client) OutboxStatus(ctx context.Context, relayGroup string) (OutboxStatus, error) {
	relayGroup = cmp.Or(relayGroup, c.cfg.Relay.ConsumerGroup)
	if err := names.Topic(relayGroup); err != nil {
		return OutboxStatus{}, fmt.Errorf("millrace: relay consumer group %q: %w", relayGroup, err)
	}
	shards, err := c.tables.RecordedShards(ctx, c.db)
	if err != nil {
		return OutboxStatus{}, err
	}
	var st store.OutboxStatus
	var states []ShardState
	if shards == 1 {
		st, err = c.tables.Status(ctx, c.db, relayGroup)
	} else {
		st, err = c.tables.ShardedStatus(ctx, c.db, relayGroup, shards)
		if err == nil {
			var list []store.ShardStatus
			list, err = c.tables.ShardStatuses(ctx, c.db, relayGroup, shards)
			for _, s := range list {
				states = append(states, ShardState{Shard: s.Shard, Owner: s.Owner, Pending: s.Pending, OldestPendingAge: s.OldestPendingAge})
			}
		}
	}
	if err != nil {
		return OutboxStatus{}, err
	}
	waits, err := c.tables.RelayWaits(ctx, c.db, c.cfg.Relay.Source == forwarder.SourceWAL)
	if err != nil {
		return OutboxStatus{}, err
	}
	broker, err := c.tables.RecordedBroker(ctx, c.db)
	if err != nil {
		return OutboxStatus{}, err
	}
	return OutboxStatus{RelayGroup: relayGroup, Pending: st.Pending, OldestPendingAge: st.OldestPendingAge,
		LastForwardedAt: st.LastForwardedAt, Forwarded: st.Forwarded, Quarantined: st.Quarantined,
		Shards: shards, ShardStates: states, Broker: broker, Waits: waits}, nil
}

// OutboxStatuses reads the outbox's state for every relay consumer group
// that has relayed from it, and for relay.consumer_group in any case.
func (c *Client) OutboxStatuses(ctx context.Context) ([]OutboxStatus, error) {
	groups, err := c.relayGroups(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]OutboxStatus, 0, len(groups))
	for _, g := range groups {
		st, err := c.OutboxStatus(ctx, g)
		if err != nil {
			return nil, err
		}
		out = append(out, st)
	}
	return out, nil
}

// relayGroups lists, sorted, the relay consumer groups that have relayed
// from the outbox, and relay.consumer_group in any case.
func (c *Client) relayGroups(ctx context.Context) ([]string, error) {
	groups, err := c.tables.RelayGroups(ctx, c.db)
	if err != nil {
		return nil, err
	}
	if !slices.Contains(groups, c.cfg.Relay.ConsumerGroup) {
		groups = append(groups, c.cfg.Relay.ConsumerGroup)
		slices.Sort(groups)
	}
	return groups, nil
}

// InboxPrune says which inbox rows PruneInbox deletes.
type InboxPrune struct {
	// OlderThan deletes rows processed longer ago than this. Required.
	OlderThan time.Duration
	// Group limits the prune to one consumer group; "" prunes every group.
	Group string
	// Batch is the rows one DELETE removes at most. Defaults to
	// consumer.inbox.cleanup_batch.
	Batch int
	// DryRun counts the rows that would be deleted and deletes nothing.
	DryRun bool
}

// InboxPruneResult is what PruneInbox did.
type InboxPruneResult struct {
	DryRun bool `json:"dry_run"` // nothing was deleted
	// Deleted counts the rows deleted; with DryRun, the rows that would be.
	Deleted   int64  `json:"deleted"`
	OlderThan string `json:"older_than"` // InboxPrune.OlderThan, as a duration
	Group     string `json:"group"`      // InboxPrune.Group
	Batch     int    `json:"batch"`      // the batch used
	// Warnings say what the prune may cost (a window shorter than
	// consumer.inbox.retention).
	Warnings []string `json:"warnings"`
}

// PruneInbox deletes inbox rows processed longer ago than p.OlderThan, in
// short statements that skip rows a concurrent prune holds. A row that is
// gone no longer deduplicates: a redelivery or replay of its event is
// processed again, hence the warning when p.OlderThan is shorter than
// consumer.inbox.retention.
func (c *Client) PruneInbox(ctx context.Context, p InboxPrune) (InboxPruneResult, error) {
	res := InboxPruneResult{DryRun: p.DryRun, OlderThan: p.OlderThan.String(), Group: p.Group,
		Batch: cmp.Or(p.Batch, c.cfg.Consumer.Inbox.CleanupBatch), Warnings: []string{}}
	switch {
	case p.OlderThan <= 0:
		return res, fmt.Errorf("millrace: prune inbox: OlderThan must be positive; got %s", p.OlderThan)
	case p.Batch < 0:
		return res, fmt.Errorf("millrace: prune inbox: Batch must be positive; got %d", p.Batch)
	}
	if p.Group != "" {
		if err := names.Topic(p.Group); err != nil {
			return res, fmt.Errorf("millrace: prune inbox: consumer group %q: %w", p.Group, err)
		}
	}
	if retention := c.cfg.Consumer.Inbox.Retention; p.OlderThan < retention {
		res.Warnings = append(res.Warnings, fmt.Sprintf("the prune window (%s) is shorter than consumer.inbox.retention (%s): "+
			"a redelivery or replay of an event whose row is deleted is processed again", p.OlderThan, retention))
	}
	var err error
	if p.DryRun {
		res.Deleted, err = c.tables.CountInboxOlder(ctx, c.db, p.OlderThan, p.Group)
	} else {
		res.Deleted, err = c.tables.PruneInbox(ctx, c.db, p.OlderThan, p.Group, res.Batch)
	}
	if err != nil {
		return res, fmt.Errorf("%w (%d rows deleted before the error)", err, res.Deleted)
	}
	return res, nil
}

// InboxRows counts the inbox rows of each consumer group.
func (c *Client) InboxRows(ctx context.Context) (map[string]int64, error) {
	return c.tables.InboxRows(ctx, c.db)
}
