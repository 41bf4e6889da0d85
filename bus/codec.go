package bus

import (
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"slices"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/millrace-io/millrace/middleware"
)

// CodecProtobuf names the protobuf codec (google.golang.org/protobuf) for
// WithCodec. CodecJSON, the default, names the JSON codec.
const CodecProtobuf = "protobuf"

// A Codec turns the values of typed topics into payloads and back. JSON and
// protobuf are built in; RegisterCodec adds others. A Codec must be safe for
// concurrent use.
type Codec interface {
	// Name is what WithCodec names it by, e.g. "json".
	Name() string
	// ContentType is the media type written in content-type, e.g.
	// "application/json". A consumer refuses a payload whose content-type
	// has another media type.
	ContentType() string
	// Marshal encodes v, a non-nil pointer to the event value (the value
	// itself when the topic's type is a pointer type).
	Marshal(v any) ([]byte, error)
	// Unmarshal decodes data into v, a non-nil pointer as for Marshal. Its
	// error should name the field or byte position at fault; a consumer
	// makes it permanent (the message is poisoned with it as the reason).
	Unmarshal(data []byte, v any) error
}

var codecs = struct {
	sync.RWMutex
	byName map[string]Codec
}{byName: map[string]Codec{CodecJSON: jsonCodec{}, CodecProtobuf: protobufCodec{}}}

// RegisterCodec makes c available to WithCodec under c.Name(), for every
// topic declared after it. It refuses a nil codec, a name already taken and
// a content type that is not a media type.
func RegisterCodec(c Codec) error {
	if c == nil {
		return errors.New("millrace: RegisterCodec: codec is nil")
	}
	name := c.Name()
	if name == "" || strings.TrimSpace(name) != name {
		return fmt.Errorf("millrace: RegisterCodec: codec name %q is empty or has surrounding white space", name)
	}
	if _, _, err := mime.ParseMediaType(c.ContentType()); err != nil {
		return fmt.Errorf("millrace: RegisterCodec(%q): content type %q: %w", name, c.ContentType(), err)
	}
	codecs.Lock()
	defer codecs.Unlock()
	if _, taken := codecs.byName[name]; taken {
		return fmt.Errorf("millrace: RegisterCodec: a codec named %q is already registered", name)
	}
	codecs.byName[name] = c
	return nil
}

// lookupCodec returns the codec registered as name.
func lookupCodec(name string) (Codec, error) {
	codecs.RLock()
	defer codecs.RUnlock()
	if c, ok := codecs.byName[name]; ok {
		return c, nil
	}
	known := make([]string, 0, len(codecs.byName))
	for n := range codecs.byName {
		known = append(known, n)
	}
	slices.Sort(known)
	return nil, fmt.Errorf("codec %q is not registered (registered: %s); register it with bus.RegisterCodec before declaring the topic",
		name, strings.Join(known, ", "))
}

// mediaType is contentType's media type, lowercase, without parameters.
func mediaType(contentType string) string {
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return strings.ToLower(strings.TrimSpace(contentType))
	}
	return mt
}

// jsonCodec is encoding/json.
type jsonCodec struct{}

func (jsonCodec) Name() string                  { return CodecJSON }
func (jsonCodec) ContentType() string           { return "application/json" }
func (jsonCodec) Marshal(v any) ([]byte, error) { return json.Marshal(v) }

// Unmarshal names the field of a type mismatch and the byte offset of a
// syntax error (middleware.DecodeJSON's *InvalidError).
func (jsonCodec) Unmarshal(data []byte, v any) error {
	return middleware.DecodeJSON(&message.Message{Payload: data}, v)
}

// protobufCodec is google.golang.org/protobuf's binary wire format; the
// topic's type must be a generated message pointer type, such as
// *orderspb.OrderPlaced.
type protobufCodec struct{}

func (protobufCodec) Name() string        { return CodecProtobuf }
func (protobufCodec) ContentType() string { return "application/x-protobuf" }

func (protobufCodec) Marshal(v any) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("protobuf codec: %T is not a protobuf message (a generated *pb.Type)", v)
	}
	// Deterministic: the same value gives the same bytes, as with JSON.
	return proto.MarshalOptions{Deterministic: true}.Marshal(m)
}

func (protobufCodec) Unmarshal(data []byte, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("protobuf codec: %T is not a protobuf message (a generated *pb.Type)", v)
	}
	err := proto.Unmarshal(data, m)
	if err == nil {
		return nil
	}
	field, where := locateProtoError(data, m.ProtoReflect().Descriptor())
	return &middleware.InvalidError{Field: field, Problem: fmt.Sprintf("not a valid %s%s: %v", m.ProtoReflect().Descriptor().FullName(), where, err), Err: err}
}

// locateProtoError finds where data stops being a valid encoding of desc's
// top-level fields: the field path and a position to add to the error, which
// proto.Unmarshal does not give.
func locateProtoError(data []byte, desc protoreflect.MessageDescriptor) (field, where string) {
	field = "payload"
	for off := 0; off < len(data); {
		num, typ, n := protowire.ConsumeTag(data[off:])
		if n < 0 {
			return field, fmt.Sprintf(" (at byte %d: bad field tag: %v)", off, protowire.ParseError(n))
		}
		fd := desc.Fields().ByNumber(num)
		name := fmt.Sprintf("field %d", num)
		if fd != nil {
			name = fmt.Sprintf("field %d (%s)", num, fd.Name())
		}
		m := protowire.ConsumeFieldValue(num, typ, data[off+n:])
		if m < 0 {
			if fd != nil {
				field = "payload." + string(fd.Name())
			}
			return field, fmt.Sprintf(" (at byte %d, %s: %v)", off, name, protowire.ParseError(m))
		}
		if fd != nil && fd.Kind() == protoreflect.StringKind && typ == protowire.BytesType {
			if s, _ := protowire.ConsumeBytes(data[off+n:]); !utf8.Valid(s) {
				return "payload." + string(fd.Name()), fmt.Sprintf(" (at byte %d, %s: invalid UTF-8)", off, name)
			}
		}
		off += n + m
	}
	return field, ""
}
