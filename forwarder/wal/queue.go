package wal

import "sync"

// Batch is consecutive committed transactions, in commit order.
type Batch struct {
	// Transactions are whole transactions, never split.
	Transactions []Transaction
}

// LSN is the end of the batch's last transaction: the position the Reader
// confirms once the batch is acknowledged.
func (b Batch) LSN() LSN {
	if len(b.Transactions) == 0 {
		return 0
	}
	return b.Transactions[len(b.Transactions)-1].EndLSN
}

// Events counts the batch's events.
func (b Batch) Events() int {
	n := 0
	for _, t := range b.Transactions {
		n += len(t.Events)
	}
	return n
}

// queue holds the transactions received and not yet handed to the
// Handler, between the goroutine reading the connection and the one
// calling the Handler.
type queue struct {
	mu        sync.Mutex
	txns      []Transaction
	events    int
	max       int
	handedOut LSN // end of the last transaction handed to the Handler
	acked     LSN // end of the last transaction the Handler acknowledged

	ready chan struct{} // signalled when transactions were pushed
	space chan struct{} // signalled when transactions were taken
}

func newQueue(maxEvents int, start LSN) *queue {
	return &queue{max: maxEvents, handedOut: start, acked: start,
		ready: make(chan struct{}, 1), space: make(chan struct{}, 1)}
}

// signal wakes the waiter on c, if it is not woken already.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// push appends t.
func (q *queue) push(t Transaction) {
	q.mu.Lock()
	q.txns = append(q.txns, t)
	q.events += len(t.Events)
	q.mu.Unlock()
	signal(q.ready)
}

// full tells whether the reader should stop reading until take.
func (q *queue) full() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.events >= q.max
}

// take removes the oldest transactions, up to max events (at least one
// transaction), as a batch; false when there is none.
func (q *queue) take() (Batch, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.txns) == 0 {
		return Batch{}, false
	}
	n, events := 0, 0
	for n < len(q.txns) && (n == 0 || events+len(q.txns[n].Events) <= q.max) {
		events += len(q.txns[n].Events)
		n++
	}
	b := Batch{Transactions: append([]Transaction(nil), q.txns[:n]...)}
	q.txns = append(q.txns[:0], q.txns[n:]...)
	q.events -= events
	q.handedOut = b.LSN()
	signal(q.space)
	return b, true
}

// ack records that the Handler acknowledged everything up to lsn.
func (q *queue) ack(lsn LSN) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.acked = max(q.acked, lsn)
}

// ackedLSN is the end of the last acknowledged transaction.
func (q *queue) ackedLSN() LSN {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.acked
}

// idle tells whether every transaction received was acknowledged.
func (q *queue) idle() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.txns) == 0 && q.acked == q.handedOut
}
