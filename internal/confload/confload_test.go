package confload

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestExpand(t *testing.T) {
	t.Parallel()
	env := func(k string) (string, bool) {
		v, ok := map[string]string{"HOST": "db", "EMPTY": ""}[k]
		return v, ok
	}
	cases := map[string]string{
		"plain":                      "plain",
		"${HOST}:5432":               "db:5432",
		"${MISSING:-fallback}":       "fallback",
		"${EMPTY:-fallback}":         "fallback",
		"${EMPTY}":                   "",
		"cost $$5 and $HOST":         "cost $5 and $HOST",
		"${HOST}/${MISSING:-x}/tail": "db/x/tail",
	}
	for in, want := range cases {
		got, err := Expand(in, env)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, bad := range []string{"${MISSING}", "${HOST", "${1BAD}", "${}"} {
		_, err := Expand(bad, env)
		require.Error(t, err, bad)
	}
}

func TestExpandSecretFile(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "password")
	require.NoError(t, os.WriteFile(path, []byte("s3cret\n"), 0o600))
	got, err := Expand("amqp://app:${file:"+path+"}@rabbit:5672/", nil)
	require.NoError(t, err)
	require.Equal(t, "amqp://app:s3cret@rabbit:5672/", got)
	_, err = Expand("${file:"+path+".missing}", nil)
	require.ErrorContains(t, err, "cannot read secret file")
	require.NotContains(t, err.Error(), "s3cret")
}

type sample struct {
	Name  string            `yaml:"name"`
	Count int               `yaml:"count"`
	Tags  []string          `yaml:"tags"`
	Inner struct{ On bool } `yaml:"inner"`
	Per   map[string]struct {
		Limit int `yaml:"limit"`
	} `yaml:"per"`
}

func TestDecodePathsInNestedShapes(t *testing.T) {
	t.Parallel()
	var s sample
	errs := Decode([]byte(`
name: x
count: ${N:-3}
tags: [a, "${N:-b}"]
inner: {on: true, off: false}
per:
  orders: {limit: 5}
  billing: {limit: many, extra: 1}
`), &s, func(string) (string, bool) { return "", false })
	require.Equal(t, 3, s.Count)
	require.Equal(t, []string{"a", "b"}, s.Tags)
	require.True(t, s.Inner.On)
	require.Equal(t, 5, s.Per["orders"].Limit)
	var paths []string
	for _, e := range errs {
		paths = append(paths, e.(*FieldError).Path)
	}
	require.ElementsMatch(t, []string{"inner.off", "per.billing.limit", "per.billing.extra"}, paths)
}
