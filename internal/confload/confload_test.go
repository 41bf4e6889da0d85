package confload

import (
	"os"
	"path/filepath"
	"testing"
	"time"

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

func TestExpandErrorsDoNotQuoteTheValue(t *testing.T) {
	t.Parallel()
	for _, secret := range []string{"hunter2${oops", "hunter2${not a name}x"} {
		_, err := Expand(secret, func(string) (string, bool) { return "", false })
		require.Error(t, err, secret)
		require.NotContains(t, err.Error(), "hunter2", "a malformed value may be a password")
	}
	var s struct {
		Password string `yaml:"password"`
	}
	errs := Decode([]byte("password: \"hunter2${oops\"\n"), &s, nil)
	require.Len(t, errs, 1)
	require.Equal(t, "password", errs[0].(*FieldError).Path)
	require.NotContains(t, errs[0].Error(), "hunter2")
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	cases := map[string]string{
		"postgres://app:hunter2@db:5432/app?sslmode=verify-full": "postgres://app:xxxxx@db:5432/app?sslmode=verify-full",
		"postgres://db/app?user=app&password=hunter2":            "postgres://db/app?password=xxxxx&user=app",
		"postgres://db/app?sslkey=/k.pem&sslpassword=hunter2":    "postgres://db/app?sslkey=%2Fk.pem&sslpassword=xxxxx",
		"amqp://guest:hunter2@rabbit:5672/":                      "amqp://guest:xxxxx@rabbit:5672/",
		"nats://127.0.0.1:4222":                                  "nats://127.0.0.1:4222",
		"postgres://app:hunter2@db:5432/%zz":                     "<unparsable URL>",
		"amqps://u:hunter2@h/?token=hunter2&cacertfile=/ca.pem":  "amqps://u:xxxxx@h/?cacertfile=%2Fca.pem&token=xxxxx",
	}
	for in, want := range cases {
		require.Equal(t, want, RedactURL(in), in)
	}
	var c Checker
	c.URL("database.url", "mysql://app:hunter2@db/app?password=hunter2", "postgres")
	require.Len(t, c.Problems, 1)
	require.NotContains(t, c.Problems[0].Error(), "hunter2")
}

// Booleans are YAML 1.2's: yaml.v3 would read yes, on and y into a bool
// (YAML 1.1), which a reader of the file takes for strings.
func TestDecodeBooleansAreYAML12(t *testing.T) {
	t.Parallel()
	type flags struct {
		On  bool  `yaml:"on"`
		Set *bool `yaml:"set"`
	}
	for _, ok := range []struct {
		doc  string
		want bool
	}{{"true", true}, {"false", false}, {"True", true}, {"FALSE", false}, {"${FLAG}", true}} {
		var f flags
		errs := Decode([]byte("on: "+ok.doc+"\nset: "+ok.doc+"\n"), &f, func(string) (string, bool) { return "true", true })
		require.Empty(t, errs, ok.doc)
		require.Equal(t, ok.want, f.On, ok.doc)
		require.NotNil(t, f.Set, ok.doc)
		require.Equal(t, ok.want, *f.Set, ok.doc)
	}
	for doc, problem := range map[string]string{
		`yes`:     `expected true or false, got "yes" (YAML 1.2 booleans are true and false only)`,
		`on`:      `expected true or false, got "on" (YAML 1.2 booleans are true and false only)`,
		`"true"`:  `expected true or false, got the quoted string "true" (remove the quotes)`,
		`'false'`: `expected true or false, got the quoted string "false" (remove the quotes)`,
		`1`:       `expected true or false, got "1"`,
		`[true]`:  `expected true or false, got a list`,
	} {
		var f flags
		errs := Decode([]byte("on: "+doc+"\nset: "+doc+"\n"), &f, nil)
		require.Len(t, errs, 2, doc)
		require.Equal(t, "on: "+problem, errs[0].Error(), doc)
		require.Equal(t, "set: "+problem, errs[1].Error(), "a *bool reads as a bool: %s", doc)
		require.False(t, f.On, doc)
		require.Nil(t, f.Set, doc)
	}
}

// Every type error is reported, each at its path, list items at their
// index, and no message names a Go type.
func TestDecodeReportsEveryTypeError(t *testing.T) {
	t.Parallel()
	var s struct {
		Name  string            `yaml:"name"`
		Count int               `yaml:"count"`
		Tags  []string          `yaml:"tags"`
		Ints  []int             `yaml:"ints"`
		Wait  time.Duration     `yaml:"wait"`
		Opt   *int              `yaml:"opt"`
		Inner struct{ On bool } `yaml:"inner"`
		Per   map[string]struct {
			Limit int `yaml:"limit"`
		} `yaml:"per"`
	}
	errs := Decode([]byte(`
name: [x]
count: many
tags: [a, {x: 1}, b, [c]]
ints: [1, two, 3, four]
wait: soon
opt: some
inner: {on: yes}
per: {orders: {limit: x}}
`), &s, nil)
	var got []string
	for _, e := range errs {
		got = append(got, e.Error())
		require.NotRegexp(t, `\*|int64|time\.|\[\]`, e.Error(), "no Go type in a message")
	}
	require.Equal(t, []string{
		`name: expected a string, got a list`,
		`count: expected an integer, got "many"`,
		`tags[1]: expected a string, got a mapping`,
		`tags[3]: expected a string, got a list`,
		`ints[1]: expected an integer, got "two"`,
		`ints[3]: expected an integer, got "four"`,
		`wait: expected a duration such as "500ms" or "10s", got "soon"`,
		`opt: expected an integer, got "some"`,
		`inner.on: expected true or false, got "yes" (YAML 1.2 booleans are true and false only)`,
		`per.orders.limit: expected an integer, got "x"`,
	}, got)
	require.Equal(t, []int{1, 0, 3, 0}, s.Ints, "the good items are kept")
}
