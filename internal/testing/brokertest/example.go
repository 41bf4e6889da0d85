package brokertest

import (
	"context"
	"log"

	"github.com/millrace-io/millrace/bus"
	"github.com/millrace-io/millrace/internal/testing/testdb"
)

// NewExampleService is NewService for an Example, which has no testing.T:
// the schema is named after name, the broker is the NATS server at
// NATSURL, each configure changes the config before the schema is
// migrated, and an error ends the program (log.Fatal). Closing drops the
// schema and closes the database.
func NewExampleService(name string, configure ...func(*bus.Config)) (s *Service, closeService func()) {
	s = &Service{}
	s.Config.Database.URL = testdb.URL()
	s.Config.Database.Schema = testdb.UniqueName(name)
	s.Config.Broker.NATS.URL = NATSURL()
	for _, f := range configure {
		f(&s.Config)
	}
	db, err := bus.OpenDB(s.Config.Database)
	if err != nil {
		log.Fatal(err)
	}
	s.DB = db
	closeService = func() {
		_, _ = db.Exec(`DROP SCHEMA "` + s.Config.Database.Schema + `" CASCADE`)
		_ = db.Close()
	}
	if err := bus.Migrate(context.Background(), db, s.Config); err != nil {
		closeService()
		log.Fatal(err)
	}
	return s, closeService
}

// NewExampleBus is NewExampleService with a Bus open on the service.
// Closing closes the Bus, then the service.
func NewExampleBus(name string, configure ...func(*bus.Config)) (b *bus.Bus, s *Service, closeAll func()) {
	s, closeService := NewExampleService(name, configure...)
	b, err := bus.Open(context.Background(), s.Config, s.DB)
	if err != nil {
		closeService()
		log.Fatal(err)
	}
	return b, s, func() { _ = b.Close(); closeService() }
}
