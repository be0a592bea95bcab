package device

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// Type identifies a kind of device: the built-in cpu and gpu, or a custom
// kind registered with RegisterType. The zero Type is cpu.
type Type uint32

// The built-in device types.
const (
	TypeCPU Type = 0
	TypeGPU Type = 1
)

// maxTypes bounds the registry so that a Type always fits the packed
// representation the process default uses.
const maxTypes = 1 << 16

// Place says where a tensor's memory lives: a device type and an index.
// Place is a comparable value; the zero Place is the CPU.
type Place struct {
	typ   Type
	index int32
}

// CPU returns the host place. There is one CPU place; its index is 0.
func CPU() Place { return Place{} }

// GPU returns the place of the i-th GPU. A negative i gives a Place that
// Valid reports as invalid; use Parse for input from users.
func GPU(i int) Place { return Place{typ: TypeGPU, index: clampIndex(i)} }

// Custom returns the i-th device of a kind registered with RegisterType.
func Custom(kind string, i int) (Place, error) {
	t, ok := lookupType(kind)
	if !ok {
		return Place{}, fmt.Errorf("device: unknown device type %q (registered: %s)", kind, strings.Join(TypeNames(), ", "))
	}
	if i < 0 || i > math.MaxInt32 {
		return Place{}, fmt.Errorf("device: index %d of %s out of range [0, %d]", i, kind, math.MaxInt32)
	}
	return Place{typ: t, index: int32(i)}, nil
}

func clampIndex(i int) int32 {
	switch {
	case i < 0:
		return -1
	case i > math.MaxInt32:
		return math.MaxInt32
	}
	return int32(i)
}

// Type returns the place's device type.
func (p Place) Type() Type { return p.typ }

// Kind returns the name of the place's device type: "cpu", "gpu" or a
// registered custom name.
func (p Place) Kind() string { return p.typ.String() }

// Index returns the device index; always 0 for the CPU.
func (p Place) Index() int { return int(p.index) }

// IsCPU reports whether p is the host.
func (p Place) IsCPU() bool { return p.typ == TypeCPU }

// IsGPU reports whether p is an NVIDIA GPU.
func (p Place) IsGPU() bool { return p.typ == TypeGPU }

// Valid reports whether p names a registered type with a non-negative index.
func (p Place) Valid() bool {
	if p.index < 0 {
		return false
	}
	if p.typ == TypeCPU {
		return p.index == 0
	}
	return int(p.typ) < len(*types.Load())
}

// String returns the canonical text form: "cpu", "gpu:1", "my_npu:0".
func (p Place) String() string {
	if p.typ == TypeCPU && p.index == 0 {
		return "cpu"
	}
	return p.typ.String() + ":" + strconv.Itoa(int(p.index))
}

// MarshalText implements encoding.TextMarshaler with the form of String.
func (p Place) MarshalText() ([]byte, error) {
	if !p.Valid() {
		return nil, fmt.Errorf("device: cannot marshal invalid place %s", p)
	}
	return []byte(p.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler with Parse.
func (p *Place) UnmarshalText(text []byte) error {
	q, err := Parse(string(text))
	if err != nil {
		return err
	}
	*p = q
	return nil
}

// String returns the registered name of t.
func (t Type) String() string {
	names := *types.Load()
	if int(t) < len(names) {
		return names[t]
	}
	return "type(" + strconv.Itoa(int(t)) + ")"
}

// Parse reads a place from its text form: "cpu", "gpu", "gpu:N", "cuda:N"
// (an alias of gpu, as torch users write it) or "kind:N" for a registered
// custom kind. A kind without an index means index 0.
func Parse(s string) (Place, error) {
	if s == "cpu" { // what every received CPU tensor names: no lookup
		return CPU(), nil
	}
	if s == "" {
		return Place{}, errors.New("device: empty place string")
	}
	kind, idx, hasIdx := strings.Cut(s, ":")
	kind = strings.ToLower(strings.TrimSpace(kind))
	if kind == "cuda" {
		kind = "gpu"
	}
	t, ok := lookupType(kind)
	if !ok {
		return Place{}, fmt.Errorf("device: unknown device type %q in %q (registered: %s)", kind, s, strings.Join(TypeNames(), ", "))
	}
	if !hasIdx {
		return Place{typ: t}, nil
	}
	n, err := strconv.ParseInt(strings.TrimSpace(idx), 10, 32)
	if err != nil {
		return Place{}, fmt.Errorf("device: bad index %q in %q: want a non-negative integer", idx, s)
	}
	if n < 0 {
		return Place{}, fmt.Errorf("device: negative index %d in %q", n, s)
	}
	if t == TypeCPU && n != 0 {
		return Place{}, fmt.Errorf("device: %q: the cpu has only index 0", s)
	}
	return Place{typ: t, index: int32(n)}, nil
}

// MustParse is Parse for places written in source code; it panics on error.
func MustParse(s string) Place {
	p, err := Parse(s)
	if err != nil {
		panic(err)
	}
	return p
}

// The type registry: an immutable slice of names replaced as a whole under
// regMu, so that reads (String, Parse) never take a lock.
var (
	regMu sync.Mutex
	types atomic.Pointer[[]string]
)

func init() {
	names := []string{"cpu", "gpu"}
	types.Store(&names)
}

// RegisterType adds a custom device type, such as "my_npu", and returns
// it. Registering a name again returns the same Type. Names are lower case
// letters, digits and '_', starting with a letter; "cuda" is reserved as
// an alias of gpu.
func RegisterType(name string) (Type, error) {
	if err := checkTypeName(name); err != nil {
		return 0, err
	}
	regMu.Lock()
	defer regMu.Unlock()
	names := *types.Load()
	if i := slices.Index(names, name); i >= 0 {
		return Type(i), nil
	}
	if len(names) >= maxTypes {
		return 0, fmt.Errorf("device: cannot register %q: %d types already registered", name, len(names))
	}
	next := append(slices.Clip(names), name)
	types.Store(&next)
	return Type(len(next) - 1), nil
}

func checkTypeName(name string) error {
	if name == "cuda" {
		return errors.New(`device: "cuda" is reserved as an alias of gpu`)
	}
	if name == "" || len(name) > 64 {
		return fmt.Errorf("device: type name %q must have 1 to 64 characters", name)
	}
	for i, c := range name {
		ok := c >= 'a' && c <= 'z' || c == '_' && i > 0 || c >= '0' && c <= '9' && i > 0
		if !ok {
			return fmt.Errorf("device: bad type name %q: use lower-case letters, digits and '_', starting with a letter", name)
		}
	}
	return nil
}

func lookupType(name string) (Type, bool) {
	i := slices.Index(*types.Load(), name)
	return Type(i), i >= 0
}

// TypeNames returns the registered type names, built-ins first.
func TypeNames() []string {
	return slices.Clone(*types.Load())
}
