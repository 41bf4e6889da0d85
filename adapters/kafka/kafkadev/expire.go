package kafkadev

import (
	"context"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// sessionExpirer removes the members of stable consumer groups that have
// not been heard from for longer than their session timeout, as Kafka does.
//
// kfake arms a member's session timer when its JoinGroup answer goes out;
// a member that dies while waiting for the answer to its first join (a
// consumer SIGKILLed while the group forms) is never answered, so it stays
// in the group for good, with partitions nobody consumes. kfake has no
// option for this, so the dev cluster does it: it notes every heartbeat,
// join and sync (kfake's request hooks), and a member silent past its
// session timeout is made to leave the group (LeaveGroup by member id).
type sessionExpirer struct {
	admin  *kadm.Client
	client *kgo.Client
	every  time.Duration
	stop   context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex
	members map[memberKey]*memberSeen
	// timeouts are the session timeouts of each group's first joins, for
	// members whose id the expirer learns from the group itself.
	timeouts map[string]time.Duration
}

type memberKey struct{ group, member string }

type memberSeen struct {
	last    time.Time
	timeout time.Duration // from the member's JoinGroup; 0 until seen
}

// groupRequestKeys are the requests that show a member alive.
var groupRequestKeys = []kmsg.Key{kmsg.JoinGroup, kmsg.SyncGroup, kmsg.Heartbeat}

func startSessionExpirer(c *kfake.Cluster, addrs []string, every time.Duration) (*sessionExpirer, error) {
	client, err := kgo.NewClient(kgo.SeedBrokers(addrs...))
	if err != nil {
		return nil, err
	}
	ctx, stop := context.WithCancel(context.Background())
	e := &sessionExpirer{admin: kadm.NewClient(client), client: client, every: every, stop: stop,
		done: make(chan struct{}), members: map[memberKey]*memberSeen{}, timeouts: map[string]time.Duration{}}
	for _, key := range groupRequestKeys {
		c.ControlKey(key.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
			e.saw(req)
			return nil, nil, false // kfake answers it as usual
		})
	}
	go e.run(ctx)
	return e, nil
}

// saw notes that req's member was heard from.
func (e *sessionExpirer) saw(req kmsg.Request) {
	var group, member string
	var timeout time.Duration
	switch r := req.(type) {
	case *kmsg.JoinGroupRequest:
		group, member, timeout = r.Group, r.MemberID, time.Duration(r.SessionTimeoutMillis)*time.Millisecond
	case *kmsg.SyncGroupRequest:
		group, member = r.Group, r.MemberID
	case *kmsg.HeartbeatRequest:
		group, member = r.Group, r.MemberID
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if member == "" { // a first join: kfake gives it its member id
		e.timeouts[group] = max(e.timeouts[group], timeout)
		return
	}
	m := e.members[memberKey{group, member}]
	if m == nil {
		m = &memberSeen{}
		e.members[memberKey{group, member}] = m
	}
	m.last = time.Now()
	if timeout > 0 {
		m.timeout = timeout
	}
}

func (e *sessionExpirer) run(ctx context.Context) {
	defer close(e.done)
	tick := time.NewTicker(e.every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			e.expire(ctx)
		}
	}
}

// expire makes every silent member of a stable group leave it. Members
// waiting in a rebalance are left to kfake: they do not heartbeat there.
func (e *sessionExpirer) expire(ctx context.Context) {
	listed, err := e.admin.ListGroups(ctx)
	if err != nil {
		return // the next tick tries again
	}
	described, err := e.admin.DescribeGroups(ctx, listed.Groups()...)
	if err != nil {
		return
	}
	now := time.Now()
	present := map[memberKey]bool{}
	var silent []memberKey
	e.mu.Lock()
	for _, g := range described {
		for _, dm := range g.Members {
			key := memberKey{g.Group, dm.MemberID}
			present[key] = true
			m := e.members[key]
			if m == nil { // joined before it could be noted: from now on
				e.members[key] = &memberSeen{last: now, timeout: e.timeouts[g.Group]}
				continue
			}
			if g.State == "Stable" && m.timeout > 0 && now.Sub(m.last) > m.timeout+e.every {
				silent = append(silent, key)
			}
		}
	}
	for key := range e.members {
		if !present[key] {
			delete(e.members, key)
		}
	}
	e.mu.Unlock()
	for _, key := range silent {
		req := kmsg.NewPtrLeaveGroupRequest()
		req.Group = key.group
		member := kmsg.NewLeaveGroupRequestMember()
		member.MemberID = key.member
		req.Members = append(req.Members, member)
		_, _ = req.RequestWith(ctx, e.client) // an error: the next tick tries again
	}
}

func (e *sessionExpirer) close() {
	e.stop()
	<-e.done
	e.client.Close()
}
