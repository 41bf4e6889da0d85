package middleware

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millrace-io/millrace/adapters"
)

func TestErrorClasses(t *testing.T) {
	t.Parallel()
	base := errors.New("boom")
	cases := []struct {
		err       error
		retryable bool
		poison    bool
	}{
		{nil, false, false},
		{base, true, false},
		{context.DeadlineExceeded, true, false},
		{adapters.Permanent(base), false, true},
		{fmt.Errorf("wrapped: %w", adapters.Permanent(base)), false, true},
		{Invalid("payload", "bad"), false, true},
		{&exhaustedError{attempts: 3, err: base}, true, true},
		{&shutdownError{cause: context.Canceled}, true, false},
		{&shutdownError{cause: adapters.Permanent(base)}, false, false},
		{&outageError{err: base}, true, false},
	}
	for _, tc := range cases {
		require.Equal(t, tc.retryable, IsRetryable(tc.err), "IsRetryable(%v)", tc.err)
		if tc.err != nil {
			require.Equal(t, tc.poison, shouldPoison(tc.err), "shouldPoison(%v)", tc.err)
		}
	}
	require.Nil(t, adapters.Permanent(nil))
	require.True(t, errors.Is(adapters.Permanent(base), base), "Permanent keeps the cause")
	require.Equal(t, ClassPermanent, classOf(Invalid("payload", "x")))
	require.Equal(t, ClassTransient, classOf(&exhaustedError{attempts: 1, err: base}))
}

func TestDecodeJSONNamesTheField(t *testing.T) {
	t.Parallel()
	type order struct {
		Amount int `json:"amount"`
		Lines  []struct {
			SKU string `json:"sku"`
		} `json:"lines"`
	}
	cases := map[string]string{
		`{"amount":"ten"}`:                "invalid payload.amount: expected int, got JSON string",
		`{"lines":[{"sku":42}]}`:          "invalid payload.lines.sku: expected string, got JSON number",
		`{"amount":`:                      "invalid payload: not valid JSON",
		`not json`:                        "invalid payload: not valid JSON at byte 2",
		`{"amount":99999999999999999999}`: "invalid payload.amount",
	}
	for payload, want := range cases {
		var o order
		err := DecodeJSON(message.NewMessage("1", []byte(payload)), &o)
		require.ErrorContains(t, err, want, payload)
		require.True(t, IsPermanent(err), payload)
	}
	var o order
	require.NoError(t, DecodeJSON(message.NewMessage("1", []byte(`{"amount":5}`)), &o))
	require.Equal(t, 5, o.Amount)

	err := DecodeJSON(message.NewMessage("1", []byte(`{}`)), o) // not a pointer: a bug in the handler
	require.Error(t, err)
	require.True(t, IsRetryable(err))
}

func TestCheckSchemaVersion(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("1", nil)
	require.NoError(t, CheckSchemaVersion(msg, 1), "no header is version 1")
	msg.Metadata.Set("schema-version", "3")
	err := CheckSchemaVersion(msg, 1, 2)
	require.EqualError(t, err, "invalid metadata.schema-version: unknown schema version 3 (this handler supports [1 2])")
	require.True(t, IsPermanent(err))
	msg.Metadata.Set("schema-version", "v2")
	require.ErrorContains(t, CheckSchemaVersion(msg, 2), `not an integer: "v2"`)
}
