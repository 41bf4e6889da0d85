package servers

import (
	"context"
	"database/sql"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/internal/testkit"
)

// A stream and its message survive a restart and a kill of the private
// NATS server, which comes back on the same URL; a client that was
// connected throughout reconnects.
func TestNATS(t *testing.T) {
	t.Parallel()
	srv := StartNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// connect opens a JetStream client on srv.URL, closed when the test ends.
	connect := func(opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
		nc, err := nats.Connect(srv.URL, opts...)
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		return nc, js
	}
	// stored returns the payload of the stream's message seq.
	stored := func(js jetstream.JetStream, seq uint64) string {
		t.Helper()
		stream, err := js.Stream(ctx, "KEEP")
		require.NoError(t, err)
		msg, err := stream.GetMsg(ctx, seq)
		require.NoError(t, err)
		return string(msg.Data)
	}

	long, longJS := connect(nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	_, err := longJS.CreateStream(ctx, jetstream.StreamConfig{
		Name: "KEEP", Subjects: []string{"keep.>"}, Storage: jetstream.FileStorage,
	})
	require.NoError(t, err)
	_, err = longJS.Publish(ctx, "keep.one", []byte("first"))
	require.NoError(t, err)

	srv.Restart()
	_, js := connect()
	require.Equal(t, "first", stored(js, 1))
	require.Eventually(t, long.IsConnected, 30*time.Second, 50*time.Millisecond, "the long-lived client did not reconnect")
	ack, err := longJS.Publish(ctx, "keep.two", []byte("second"))
	require.NoError(t, err)
	require.EqualValues(t, 2, ack.Sequence)

	// A killed server loses no stream either (the operating system keeps
	// what was written).
	srv.Kill()
	srv.Start()
	_, js = connect()
	require.Equal(t, "first", stored(js, 1))
	_, err = js.Publish(ctx, "keep.three", []byte("third"))
	require.NoError(t, err)

	srv.Stop()
	srv.Stop() // stopping a stopped server does nothing
	_, err = nats.Connect(srv.URL, nats.Timeout(time.Second))
	require.Error(t, err, "the server still answers after Stop")
	srv.Start()
	_, js = connect()
	require.Equal(t, "third", stored(js, 3))

	// RestartCommand kills the server from outside; supervision brings it
	// back on the same URL and store.
	restart := srv.RestartCommand()
	require.NoError(t, exec.Command(restart[0], restart[1:]...).Run())
	testkit.Eventually(t, time.Minute, "the supervised server answers again", func() bool {
		nc, err := nats.Connect(srv.URL, nats.Timeout(time.Second))
		if err != nil {
			return false
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		stream, err := js.Stream(ctx, "KEEP")
		if err != nil {
			return false
		}
		msg, err := stream.GetMsg(ctx, 3)
		return err == nil && string(msg.Data) == "third"
	})
}

// The embedded server keeps its port and its streams across Restart.
func TestEmbeddedNATS(t *testing.T) {
	t.Parallel()
	srv := StartEmbeddedNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nc, err := nats.Connect(srv.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "KEEP", Subjects: []string{"keep.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "keep.one", []byte("first"))
	require.NoError(t, err)

	url := srv.URL
	srv.Restart()
	require.Equal(t, url, srv.URL)
	testkit.Eventually(t, 30*time.Second, "the client reconnects", nc.IsConnected)
	stream, err := js.Stream(ctx, "KEEP")
	require.NoError(t, err)
	msg, err := stream.GetMsg(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, "first", string(msg.Data))
}

// A committed row survives a crash restart (with crash recovery) of the
// private PostgreSQL cluster and a clean stop and start; the URL stays the
// same.
func TestPostgreSQL(t *testing.T) {
	t.Parallel()
	pg := StartPostgreSQL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	open := func() *sql.DB {
		db, err := sql.Open("pgx", pg.URL)
		require.NoError(t, err)
		t.Cleanup(func() { db.Close() })
		return db
	}
	rows := func(db *sql.DB) []string {
		t.Helper()
		r, err := db.QueryContext(ctx, `SELECT note FROM kept ORDER BY id`)
		require.NoError(t, err)
		defer r.Close()
		var notes []string
		for r.Next() {
			var note string
			require.NoError(t, r.Scan(&note))
			notes = append(notes, note)
		}
		require.NoError(t, r.Err())
		return notes
	}

	db := open()
	_, err := db.ExecContext(ctx, `CREATE TABLE kept (id int PRIMARY KEY, note text NOT NULL)`)
	require.NoError(t, err)
	_, err = db.ExecContext(ctx, `INSERT INTO kept VALUES (1, 'before the crash')`)
	require.NoError(t, err)
	var max int
	require.NoError(t, db.QueryRowContext(ctx, `SHOW max_connections`).Scan(&max))
	require.Equal(t, 200, max)

	pg.Restart()
	logs, err := os.ReadFile(pg.logFile)
	require.NoError(t, err)
	require.Contains(t, string(logs), "not properly shut down", "Restart did not make the server recover from a crash")
	db = open()
	require.Equal(t, []string{"before the crash"}, rows(db))
	_, err = db.ExecContext(ctx, `INSERT INTO kept VALUES (2, 'after the crash')`)
	require.NoError(t, err)

	pg.Stop()
	pg.Stop() // stopping a stopped cluster does nothing
	require.Error(t, db.PingContext(ctx), "the cluster still answers after Stop")
	pg.Start()
	require.Equal(t, []string{"before the crash", "after the crash"}, rows(open()))
}
