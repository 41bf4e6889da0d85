package bus

import (
	"context"
	"database/sql"

	"github.com/millrace-io/millrace/middleware"
)

// Tx returns the transaction of the message a handler is processing: the
// one its inbox row was inserted in, committed by millrace after the handler
// returns nil and before the message is acked. Do the handler's business
// writes, and any Publish of follow-up events, in it. It is nil outside a
// handler or when the handler's inbox and ordering guard are both off.
func Tx(ctx context.Context) *sql.Tx { return middleware.Tx(ctx) }
