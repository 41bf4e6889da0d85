package confload

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"slices"
	"sort"
	"strings"

	"go.yaml.in/yaml/v3"
)

// FieldError is one configuration problem: the dotted YAML path it belongs to
// and what was wrong or expected there.
type FieldError struct {
	// Path is the dotted YAML path, e.g. "broker.rabbitmq.url".
	Path string
	// Problem says what was expected or wrong.
	Problem string
}

func (e *FieldError) Error() string {
	if e.Path == "" {
		return e.Problem
	}
	return e.Path + ": " + e.Problem
}

// Errorf returns a *FieldError for path.
func Errorf(path, format string, args ...any) error {
	return &FieldError{Path: path, Problem: fmt.Sprintf(format, args...)}
}

// Join returns the dotted path of child under parent.
func Join(parent, child string) string {
	if parent == "" {
		return child
	}
	return parent + "." + child
}

// LookupEnv looks up an environment variable; tests replace it.
type LookupEnv func(name string) (string, bool)

// Decode parses YAML from data into out (a pointer to a struct with yaml tags).
// Scalars have ${VAR} and ${VAR:-default} expanded from lookup ("$$" is a literal "$").
// Unknown keys, duplicate keys, type mismatches (each bad item of a list
// at its index) and unset variables are all reported, each as a
// *FieldError naming its path and what a value there looks like, never a
// Go type; decoding goes on after a problem so that one call reports every
// problem at once. Booleans are YAML 1.2's: true and false (or True, TRUE,
// False, FALSE), unquoted; YAML 1.1's yes, no, on and off are refused.
func Decode(data []byte, out any, lookup LookupEnv) []error {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil // an empty document is a config with every default
		}
		return []error{&FieldError{Problem: "invalid YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")}}
	}
	var rest yaml.Node
	if err := dec.Decode(&rest); err == nil {
		return []error{&FieldError{Problem: "invalid YAML: more than one document; millrace reads a single document"}}
	}
	d := decoder{lookup: lookup}
	root := &doc
	if root.Kind == yaml.DocumentNode && len(root.Content) == 1 {
		root = root.Content[0]
	}
	d.decode(root, reflect.ValueOf(out).Elem(), "")
	return d.problems
}

type decoder struct {
	lookup   LookupEnv
	problems []error
}

func (d *decoder) fail(path, format string, args ...any) {
	d.problems = append(d.problems, Errorf(path, format, args...))
}

func (d *decoder) decode(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return // "key:" with no value keeps the default
	}
	switch {
	case v.Kind() == reflect.Struct && !isLeafStruct(v.Type()):
		d.decodeStruct(n, v, path)
	case v.Kind() == reflect.Map && n.Kind == yaml.MappingNode:
		d.decodeMap(n, v, path)
	case v.Kind() == reflect.Slice && n.Kind == yaml.SequenceNode:
		// Item by item, so that each bad item is reported with its index.
		s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
		for i, item := range n.Content {
			d.decode(item, s.Index(i), fmt.Sprintf("%s[%d]", path, i))
		}
		v.Set(s)
	case v.Kind() == reflect.Pointer && !isLeafKind(v.Type().Elem()):
		p := reflect.New(v.Type().Elem())
		d.decode(n, p.Elem(), path)
		v.Set(p)
	default:
		d.decodeLeaf(n, v, path)
	}
}

func (d *decoder) decodeStruct(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		// The value is not quoted: a misplaced password (sasl: s3cret) would be.
		shape := "a single value"
		if n.Kind == yaml.SequenceNode {
			shape = "a list"
		}
		d.fail(path, "expected a mapping of keys, got %s", shape)
		return
	}
	fields := structFields(v.Type())
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		key, val := n.Content[i].Value, n.Content[i+1]
		keyPath := Join(path, key)
		if seen[key] {
			d.fail(keyPath, "duplicate key")
			continue
		}
		seen[key] = true
		idx, ok := fields[key]
		if !ok {
			d.fail(keyPath, "unknown key (known keys: %s)", strings.Join(sortedKeys(fields), ", "))
			continue
		}
		d.decode(val, v.Field(idx), keyPath)
	}
}

func (d *decoder) decodeMap(n *yaml.Node, v reflect.Value, path string) {
	if v.IsNil() {
		v.Set(reflect.MakeMap(v.Type()))
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		keyNode, valNode := n.Content[i], n.Content[i+1]
		keyPath := Join(path, keyNode.Value)
		key := reflect.New(v.Type().Key()).Elem()
		d.decodeLeaf(keyNode, key, keyPath)
		if v.MapIndex(key).IsValid() {
			d.fail(keyPath, "duplicate key")
			continue
		}
		elem := reflect.New(v.Type().Elem()).Elem()
		d.decode(valNode, elem, keyPath)
		v.SetMapIndex(key, elem)
	}
}

func (d *decoder) decodeLeaf(n *yaml.Node, v reflect.Value, path string) {
	if !d.expandNode(n, path) {
		return
	}
	if isBool(v.Type()) {
		if problem := boolProblem(n); problem != "" {
			d.fail(path, "%s", problem)
			return
		}
	}
	target := reflect.New(v.Type())
	if err := n.Decode(target.Interface()); err != nil {
		d.fail(path, "expected %s, got %s", typeName(v.Type()), describe(n))
		return
	}
	v.Set(target.Elem())
}

// yamlBools are the booleans of YAML 1.2's core schema.
var yamlBools = []string{"true", "True", "TRUE", "false", "False", "FALSE"}

// yaml11Bools are YAML 1.1's other spellings of booleans, which yaml.v3
// still reads into a bool and YAML 1.2 reads as strings.
var yaml11Bools = []string{"y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF"}

// isBool reports whether t is bool or a pointer to one.
func isBool(t reflect.Type) bool {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t.Kind() == reflect.Bool
}

// boolProblem says why n is not a YAML 1.2 boolean, or returns "": a
// quoted "true" is a string, and yes, on and their kin are YAML 1.1's,
// which a reader of YAML 1.2 (and of config.yaml) takes for strings.
func boolProblem(n *yaml.Node) string {
	switch {
	case n.Kind != yaml.ScalarNode:
		return fmt.Sprintf("expected true or false, got %s", describe(n))
	case n.ShortTag() == "!!bool" && slices.Contains(yamlBools, n.Value):
		return ""
	case slices.Contains(yamlBools, n.Value):
		return fmt.Sprintf("expected true or false, got the quoted string %q (remove the quotes)", n.Value)
	case slices.Contains(yaml11Bools, n.Value):
		return fmt.Sprintf("expected true or false, got %q (YAML 1.2 booleans are true and false only)", n.Value)
	}
	return fmt.Sprintf("expected true or false, got %q", n.Value)
}

// expandNode substitutes environment variables in every scalar under n.
func (d *decoder) expandNode(n *yaml.Node, path string) bool {
	ok := true
	switch n.Kind {
	case yaml.ScalarNode:
		if !strings.Contains(n.Value, "$") {
			return true
		}
		expanded, err := Expand(n.Value, d.lookup)
		if err != nil {
			d.fail(path, "%v", err)
			return false
		}
		if expanded != n.Value {
			n.Value = expanded
			if n.Style&(yaml.TaggedStyle|yaml.DoubleQuotedStyle|yaml.SingleQuotedStyle|yaml.LiteralStyle|yaml.FoldedStyle) == 0 {
				n.Tag = "" // a plain scalar: let the expanded text resolve as a number, bool or duration
			}
		}
	default:
		for _, c := range n.Content {
			ok = d.expandNode(c, path) && ok
		}
	}
	return ok
}

// Expand replaces ${VAR} and ${VAR:-default} in s with environment
// variables and ${file:PATH} with the contents of a file (a mounted secret,
// without its trailing newline); "$$" stands for "$". An unset variable
// without a default, or an unreadable file, is an error naming it.
func Expand(s string, lookup LookupEnv) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' {
			b.WriteByte(s[i])
			continue
		}
		if i+1 < len(s) && s[i+1] == '$' {
			b.WriteByte('$')
			i++
			continue
		}
		if i+1 >= len(s) || s[i+1] != '{' {
			b.WriteByte('$')
			continue
		}
		end := strings.IndexByte(s[i:], '}')
		if end < 0 {
			// The value is not quoted: it may be a secret with a stray "${".
			return "", fmt.Errorf(`unterminated "${" (no closing "}"; write "$$" for a literal "$")`)
		}
		expr := s[i+2 : i+end]
		if path, ok := strings.CutPrefix(expr, "file:"); ok {
			secret, err := readSecretFile(path)
			if err != nil {
				return "", err
			}
			b.WriteString(secret)
			i += end
			continue
		}
		name, def, hasDefault := strings.Cut(expr, ":-")
		if !validEnvName(name) {
			// Not quoted either: a secret may contain "${...}" by mistake.
			return "", fmt.Errorf(`invalid variable name in "${...}": names are letters, digits and '_', not starting with a digit (write "$$" for a literal "$")`)
		}
		val, set := lookup(name)
		switch {
		case set && val != "":
			b.WriteString(val)
		case hasDefault:
			b.WriteString(def)
		case set:
			// set but empty, and no default: an empty value is what was asked for
		default:
			return "", fmt.Errorf("environment variable %s is not set (use ${%s:-default} for a fallback)", name, name)
		}
		i += end
	}
	return b.String(), nil
}

func readSecretFile(path string) (string, error) {
	if path == "" {
		return "", fmt.Errorf("${file:} needs a path")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		// The error names the file, never its contents.
		return "", fmt.Errorf("cannot read secret file %s: %v", path, errors.Unwrap(err))
	}
	return strings.TrimRight(string(data), "\r\n"), nil
}

func validEnvName(name string) bool {
	if name == "" {
		return false
	}
	for i, r := range name {
		if r == '_' || (r >= 'A' && r <= 'Z') || (r >= 'a' && r <= 'z') || (i > 0 && r >= '0' && r <= '9') {
			continue
		}
		return false
	}
	return true
}

// structFields maps yaml keys to field indexes.
func structFields(t reflect.Type) map[string]int {
	m := make(map[string]int, t.NumField())
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		m[name] = i
	}
	return m
}

func sortedKeys(m map[string]int) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// isLeafStruct reports struct types that decode from a scalar (they implement yaml.Unmarshaler).
func isLeafStruct(t reflect.Type) bool {
	return reflect.PointerTo(t).Implements(unmarshalerType)
}

func isLeafKind(t reflect.Type) bool {
	return t.Kind() != reflect.Struct || isLeafStruct(t)
}

var unmarshalerType = reflect.TypeOf((*yaml.Unmarshaler)(nil)).Elem()

// typeName says what a value of t looks like in YAML, in words a reader
// of config.yaml knows (never a Go type).
func typeName(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t.String() == "time.Duration":
		return `a duration such as "500ms" or "10s"`
	case t.Kind() == reflect.Bool:
		return "true or false"
	case t.Kind() >= reflect.Int && t.Kind() <= reflect.Int64, t.Kind() >= reflect.Uint && t.Kind() <= reflect.Uint64:
		return "an integer"
	case t.Kind() == reflect.Float32 || t.Kind() == reflect.Float64:
		return "a number"
	case t.Kind() == reflect.String:
		return "a string"
	case t.Kind() == reflect.Slice:
		return "a list of " + strings.TrimPrefix(strings.TrimPrefix(typeName(t.Elem()), "a "), "an ") + "s"
	case t.Kind() == reflect.Map:
		return "a mapping"
	}
	return "a value of the kind config.yaml shows"
}

func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return fmt.Sprintf("%q", n.Value)
	}
	return "an unexpected node"
}
