package envelope

import (
	"bytes"
	"encoding/json"
	"errors"
	"maps"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

func TestWrapUnwrapRoundTrip(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("id-1", []byte{0, 1, 2, 0xff})
	msg.Metadata.Set(EventTypeKey, "X")
	payload, err := Wrap("orders.events", msg)
	require.NoError(t, err)
	topic, got, err := Unwrap(payload)
	require.NoError(t, err)
	require.Equal(t, "orders.events", topic)
	require.Equal(t, msg.UUID, got.UUID)
	require.Equal(t, msg.Payload, got.Payload)
	require.Equal(t, "X", got.Metadata.Get(EventTypeKey))

	_, err = Wrap("", msg)
	require.ErrorIs(t, err, ErrNoDestination)
}

func TestUnwrapRejectsBadEnvelopes(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]error{
		`"text"`:                          ErrCorrupt,
		`{"destination_topic": 5}`:        ErrCorrupt,
		`{"payload": "not base64!"}`:      ErrCorrupt,
		`{}`:                              ErrNoDestination,
		`{"destination_topic": ""}`:       ErrNoDestination,
		`{"destination_topic":"t"} extra`: ErrCorrupt,
	} {
		_, _, err := Unwrap([]byte(in))
		require.True(t, errors.Is(err, want), "%s: %v", in, err)
	}
}

func FuzzUnwrap(f *testing.F) {
	msg := message.NewMessage("id", []byte(`{"a":1}`))
	msg.Metadata.Set("k", "v")
	good, _ := Wrap("topic", msg)
	for _, seed := range [][]byte{good, []byte(`{}`), []byte(`null`), []byte(`{"destination_topic":"t","metadata":null}`), nil} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		topic, got, err := Unwrap(data)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrNoDestination) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		if topic == "" || got == nil || got.Metadata == nil {
			t.Fatalf("accepted envelope without topic or message: %q", data)
		}
		again, err := Wrap(topic, got)
		if err != nil {
			t.Fatal(err)
		}
		topic2, got2, err := Unwrap(again)
		if err != nil || topic2 != topic || got2.UUID != got.UUID || string(got2.Payload) != string(got.Payload) {
			t.Fatalf("round trip changed the envelope: %q", data)
		}
	})
}

// FuzzUnwrapAgreesWithEncodingJSON holds Unwrap's decoder to encoding/json's
// semantics: the same envelopes accepted, with the same contents, so that
// the faster decoder quarantines nothing encoding/json would have relayed.
func FuzzUnwrapAgreesWithEncodingJSON(f *testing.F) {
	for _, seed := range []string{
		`{"destination_topic":"t","uuid":"u","payload":"eyJhIjoxfQ==","metadata":{"k":"v"}}`,
		`{"DESTINATION_TOPIC":"t","Uuid":"u"}`,
		`{"destination_topic":"a","destination_topic":"b"}`,
		"{\"destination_topic\":\"t\",\"metadata\":{\"k\":\"\xff\"}}",
		`{"destination_topic":"t","payload":"eyJh\nIjoxfQ=="}`,
		`{"destination_topic":"t","payload":null,"metadata":null}`,
		`{"destination_topic":"t","metadata":{"k":1}}`,
		`{"destination_topic":"t","extra":[1,{"x":2}]}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var want forwarderEnvelope
		v1Err := json.Unmarshal(data, &want)
		topic, got, err := Unwrap(data)
		switch {
		case v1Err != nil:
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("encoding/json refuses %q (%v), Unwrap: %v", data, v1Err, err)
			}
		case want.DestinationTopic == "":
			if !errors.Is(err, ErrNoDestination) {
				t.Fatalf("no destination in %q, Unwrap: %v", data, err)
			}
		case err != nil:
			t.Fatalf("encoding/json accepts %q, Unwrap: %v", data, err)
		default:
			if topic != want.DestinationTopic || got.UUID != want.UUID || !bytes.Equal(got.Payload, want.Payload) ||
				(want.Metadata != nil && !maps.Equal(map[string]string(got.Metadata), want.Metadata)) {
				t.Fatalf("%q: Unwrap gives %q %q %q %v, encoding/json %+v", data, topic, got.UUID, got.Payload, got.Metadata, want)
			}
		}
	})
}
