package tests

import (
	"bufio"
	"bytes"
	"go/importer"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The public packages of both modules, by the folder of their module.
var publicPackages = map[string][]string{
	"..":      {"./device", "./strategy", "./mmapalloc", "./tensor", "./cuda", "./reduction", "./mp", "./loader"},
	"../dist": {"."},
}

// TestPublicAPIHidesInternalTypes type-checks every public package of
// both modules (from the compiler's export data) and fails for each
// exported declaration whose type reaches a type of an internal package:
// through a signature, a variable's inferred type, an alias in any file,
// an exported field or method, or a type argument. What siblings need of
// each other stays out of what users see.
func TestPublicAPIHidesInternalTypes(t *testing.T) {
	var leaks []string
	for dir, pkgs := range publicPackages {
		exports := exportData(t, dir, pkgs...)
		for _, path := range exports.roots {
			leaks = append(leaks, internalTypesIn(t, exports, path)...)
		}
	}
	sort.Strings(leaks)
	assert.Empty(t, leaks, "exported declarations that name internal types")
}

// The check catches what a reading of the syntax missed: a variable whose
// internal type is inferred, and an internal type laundered through an
// unexported alias declared in another file (testdata/apileak), while an
// exported error whose value comes from an internal package passes.
func TestPublicAPICheckSeesInferredAndAliasedTypes(t *testing.T) {
	exports := exportData(t, "..", "./tests/testdata/apileak")
	require.Len(t, exports.roots, 1)
	leaks := internalTypesIn(t, exports, exports.roots[0])
	assert.ElementsMatch(t, []string{"Inferred", "Laundered", "Direct"}, shortNames(leaks))
}

// exports is the compiler's export data of some packages and of all they
// import, and the import paths of those packages.
type exports struct {
	files map[string]string // import path -> export data file
	roots []string
}

// exportData has the go command build the packages pkgs of the module in
// dir and their dependencies, and returns where their export data is.
func exportData(t *testing.T, dir string, pkgs ...string) exports {
	t.Helper()
	args := append([]string{"list", "-export", "-deps", "-f", "{{.ImportPath}} {{.Export}} {{.DepOnly}}"}, pkgs...)
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "go list: %s", stderr.String())
	e := exports{files: map[string]string{}}
	lines := bufio.NewScanner(bytes.NewReader(out))
	for lines.Scan() {
		f := strings.Fields(lines.Text())
		if len(f) != 3 || f[1] == "" {
			continue
		}
		e.files[f[0]] = f[1]
		if f[2] == "false" {
			e.roots = append(e.roots, f[0])
		}
	}
	return e
}

// internalTypesIn returns path's exported declarations whose types reach
// a type of an internal package, as "path.Name".
func internalTypesIn(t *testing.T, e exports, path string) []string {
	t.Helper()
	imp := importer.ForCompiler(token.NewFileSet(), "gc", func(p string) (io.ReadCloser, error) {
		return os.Open(e.files[p])
	})
	pkg, err := imp.Import(path)
	require.NoError(t, err, "importing %s", path)
	var leaks []string
	for _, name := range pkg.Scope().Names() {
		obj := pkg.Scope().Lookup(name)
		if !obj.Exported() {
			continue
		}
		w := &walker{seen: map[types.Type]bool{}}
		w.object(obj)
		if w.leak != "" {
			leaks = append(leaks, path+"."+name+" ("+w.leak+")")
		}
	}
	return leaks
}

// walker looks for a named type of an internal package in what an
// exported declaration lets a user see.
type walker struct {
	seen map[types.Type]bool
	leak string // the first internal type found
}

func (w *walker) object(obj types.Object) {
	tn, isType := obj.(*types.TypeName)
	if !isType {
		w.typ(obj.Type())
		return
	}
	if tn.IsAlias() {
		w.typ(types.Unalias(tn.Type()))
		return
	}
	named, _ := tn.Type().(*types.Named)
	if named == nil {
		return
	}
	w.exposed(named.Underlying())
	for i := range named.NumMethods() {
		if m := named.Method(i); m.Exported() {
			w.typ(m.Type())
		}
	}
}

// typ walks a type a user sees whole.
func (w *walker) typ(t types.Type) {
	if w.leak != "" || t == nil || w.seen[t] {
		return
	}
	w.seen[t] = true
	switch x := t.(type) {
	case *types.Alias:
		w.typ(types.Unalias(x))
	case *types.Named:
		if p := x.Obj().Pkg(); p != nil && strings.Contains(p.Path()+"/", "/internal/") {
			w.leak = p.Path() + "." + x.Obj().Name()
			return
		}
		for i := range x.TypeArgs().Len() {
			w.typ(x.TypeArgs().At(i))
		}
	case *types.Pointer:
		w.typ(x.Elem())
	case *types.Slice:
		w.typ(x.Elem())
	case *types.Array:
		w.typ(x.Elem())
	case *types.Map:
		w.typ(x.Key())
		w.typ(x.Elem())
	case *types.Chan:
		w.typ(x.Elem())
	case *types.Signature:
		w.typ(x.Params())
		w.typ(x.Results())
	case *types.Tuple:
		for i := range x.Len() {
			w.typ(x.At(i).Type())
		}
	default:
		w.exposed(t)
	}
}

// exposed walks the exported parts of a type's structure: a struct's
// exported and embedded fields, an interface's methods.
func (w *walker) exposed(t types.Type) {
	switch x := t.(type) {
	case *types.Struct:
		for i := range x.NumFields() {
			if f := x.Field(i); f.Exported() || f.Embedded() {
				w.typ(f.Type())
			}
		}
	case *types.Interface:
		for i := range x.NumMethods() {
			w.typ(x.Method(i).Type())
		}
		for i := range x.NumEmbeddeds() {
			w.typ(x.EmbeddedType(i))
		}
	default:
		w.typ(t)
	}
}

// shortNames returns the declaration names of leaks ("path.Name (...)").
func shortNames(leaks []string) []string {
	var out []string
	for _, l := range leaks {
		l, _, _ = strings.Cut(l, " ")
		out = append(out, filepath.Ext(l)[1:])
	}
	return out
}
