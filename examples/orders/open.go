package orders

import (
	"context"
	"database/sql"

	"github.com/millrace-io/millrace/bus"
)

// Open is how the example commands start: it loads the config at path,
// opens its database and migrates it, creates the command's own tables
// with setup (Setup, billing.Setup) and opens a Bus on the database. The
// caller closes the Bus, then the database.
func Open(ctx context.Context, path string, setup func(context.Context, *sql.DB, string) error) (bus.Config, *sql.DB, *bus.Bus, error) {
	cfg, err := bus.LoadConfig(path)
	if err != nil {
		return cfg, nil, nil, err
	}
	db, err := bus.OpenDB(cfg.Database)
	if err != nil {
		return cfg, nil, nil, err
	}
	err = bus.Migrate(ctx, db, cfg)
	if err == nil {
		err = setup(ctx, db, cfg.Database.Schema)
	}
	var b *bus.Bus
	if err == nil {
		b, err = bus.Open(ctx, cfg, db)
	}
	if err != nil {
		_ = db.Close()
		return cfg, nil, nil, err
	}
	return cfg, db, b, nil
}
