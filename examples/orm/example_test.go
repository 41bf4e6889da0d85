package orm_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"net/url"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/examples/orm"
	"github.com/millrace-io/millrace/internal/testing/brokertest"
)

// OrderPlaced is the examples' event.
type OrderPlaced struct {
	OrderID    string `json:"order_id"`
	TotalCents int64  `json:"total_cents"`
}

func (OrderPlaced) EventType() string             { return "OrderPlaced" }
func (e OrderPlaced) Aggregate() (string, string) { return "order", e.OrderID }

var orderPlaced = bus.Must(bus.NewTopic[OrderPlaced]("orders.events"))

// Order and Invoice are GORM models.
type Order struct {
	ID         string
	TotalCents int64
}

type Invoice struct {
	OrderID string `gorm:"primaryKey"`
	EventID string
}

// GORM: publish in the *sql.Tx of gorm's Transaction; in a handler, run
// gorm on bus.Tx[*sql.Tx](ctx).
func Example_gorm() {
	ctx := context.Background()
	b, svc, closeAll := exampleBus("example_gorm")
	defer closeAll()
	db := svc.DB
	gdb, err := gorm.Open(postgres.New(postgres.Config{Conn: db}), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		log.Fatal(err)
	}

	// Publish: in gorm's Transaction, tx.Statement.ConnPool is its *sql.Tx,
	// a bus.Execer.
	order := OrderPlaced{OrderID: "ord-1", TotalCents: 4200}
	err = gdb.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if err := tx.Create(&Order{ID: order.OrderID, TotalCents: order.TotalCents}).Error; err != nil {
			return err
		}
		return orderPlaced.Publish(ctx, b, tx.Statement.ConnPool, order)
	})
	if err != nil {
		log.Fatal(err)
	}

	// Consume: gorm on the inbox transaction, so the invoice commits with
	// the inbox row.
	handle, err := b.ConsumerChainTypes(ctx, "billing", []bus.Route{bus.On(orderPlaced, func(ctx context.Context, m bus.Message[OrderPlaced]) error {
		tx := gdb.WithContext(ctx).Session(&gorm.Session{NewDB: true})
		tx.Statement.ConnPool = bus.Tx[*sql.Tx](ctx)
		return tx.Create(&Invoice{OrderID: m.Value.OrderID, EventID: m.ID}).Error
	})}, nil) // b.HandleTypes("billing", routes) for Run; here the chain without a broker
	if err != nil {
		log.Fatal(err)
	}
	deliverTwice(ctx, handle, order)

	var invoices, events int64
	gdb.Model(&Invoice{}).Count(&invoices)
	if err := db.QueryRow(`SELECT count(*) FROM watermill_millrace_outbox`).Scan(&events); err != nil {
		log.Fatal(err)
	}
	fmt.Println("events:", events, "invoices:", invoices)
	// Output: events: 1 invoices: 1
}

// sqlc, database/sql mode: WithTx(bus.Tx[*sql.Tx](ctx)). pgx mode, on a
// Bus opened on a *pgxpool.Pool: WithTx(bus.Tx[pgx.Tx](ctx)).
func Example_sqlc() {
	ctx := context.Background()
	b, svc, closeAll := exampleBus("example_sqlc")
	defer closeAll()
	db, cfg := svc.DB, svc.Config

	// database/sql mode.
	queries := orm.New(db)
	handle, err := b.ConsumerChainTypes(ctx, "billing", []bus.Route{bus.On(orderPlaced, func(ctx context.Context, m bus.Message[OrderPlaced]) error {
		return queries.WithTx(bus.Tx[*sql.Tx](ctx)).CreateInvoice(ctx, m.Value.OrderID, m.ID)
	})}, nil)
	if err != nil {
		log.Fatal(err)
	}
	deliverTwice(ctx, handle, OrderPlaced{OrderID: "ord-1"})

	// pgx mode.
	pool, err := pgxpool.New(ctx, cfg.Database.URL)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	pb, err := bus.Open(ctx, cfg, pool)
	if err != nil {
		log.Fatal(err)
	}
	defer pb.Close()
	pgxQueries := orm.NewPgx(pool)
	handle, err = pb.ConsumerChainTypes(ctx, "billing-pgx", []bus.Route{bus.On(orderPlaced, func(ctx context.Context, m bus.Message[OrderPlaced]) error {
		return pgxQueries.WithTx(bus.Tx[pgx.Tx](ctx)).CreateInvoice(ctx, m.Value.OrderID, m.ID)
	})}, nil)
	if err != nil {
		log.Fatal(err)
	}
	deliverTwice(ctx, handle, OrderPlaced{OrderID: "ord-2"})

	var invoices int
	if err := db.QueryRow(`SELECT count(*) FROM invoices`).Scan(&invoices); err != nil {
		log.Fatal(err)
	}
	fmt.Println("invoices:", invoices)
	// Output: invoices: 2
}

// exampleBus opens a Bus on a migrated schema of the example's own, with
// the examples' tables, on a pool whose search_path is that schema.
func exampleBus(name string) (*bus.Bus, *brokertest.Service, func()) {
	b, svc, closeAll := brokertest.NewExampleBus(name, func(cfg *bus.Config) {
		u, err := url.Parse(cfg.Database.URL)
		if err != nil {
			log.Fatal(err)
		}
		q := u.Query()
		q.Set("search_path", cfg.Database.Schema)
		u.RawQuery = q.Encode()
		cfg.Database.URL = u.String()
	})
	if _, err := svc.DB.Exec(`CREATE TABLE orders (id text PRIMARY KEY, total_cents bigint NOT NULL);
		CREATE TABLE invoices (order_id text PRIMARY KEY, event_id text NOT NULL)`); err != nil {
		closeAll()
		log.Fatal(err)
	}
	return b, svc, closeAll
}

// deliverTwice hands the chain the event of v twice, as at-least-once
// delivery may.
func deliverTwice(ctx context.Context, handle message.NoPublishHandlerFunc, v OrderPlaced) {
	ev, err := orderPlaced.Event(v)
	if err != nil {
		log.Fatal(err)
	}
	for range 2 {
		msg := message.NewMessage("evt-"+v.OrderID, ev.Payload)
		msg.Metadata = message.Metadata{bus.EventIDKey: "evt-" + v.OrderID, bus.EventTypeKey: ev.Type,
			bus.SchemaVersionKey: strconv.Itoa(ev.SchemaVersion), bus.ContentTypeKey: ev.ContentType,
			bus.AggregateTypeKey: ev.AggregateType, bus.AggregateIDKey: ev.AggregateID}
		msg.SetContext(ctx)
		if err := handle(msg); err != nil {
			log.Fatal(err)
		}
	}
}
