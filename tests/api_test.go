package tests

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPublicAPIHidesInternalTypes reads every public package of both
// modules and fails for each exported declaration whose type names a type
// of an internal package: what siblings need of each other stays out of
// what users see.
func TestPublicAPIHidesInternalTypes(t *testing.T) {
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	var leaks []string
	read := map[string]bool{}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch filepath.Base(rel) {
			case "internal", "cmd", "tests", "testdata", "python", ".ci", ".git":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(rel, ".go") || strings.HasSuffix(rel, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if f.Name.Name == "main" {
			return nil
		}
		read[filepath.Dir(rel)] = true
		for _, name := range exportedInternalTypes(f) {
			leaks = append(leaks, rel+": "+name)
		}
		return nil
	})
	require.NoError(t, err)
	for _, pkg := range []string{"device", "strategy", "mmapalloc", "tensor", "cuda", "reduction", "mp", "loader", "dist"} {
		require.True(t, read[pkg], "public package %s was read", pkg)
	}
	assert.Empty(t, leaks, "exported declarations that name internal types")
}

// exportedInternalTypes returns the exported declarations of f whose
// types name a package imported from an internal/ path.
func exportedInternalTypes(f *ast.File) []string {
	internal := map[string]bool{}
	for _, imp := range f.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		if !strings.Contains(path, "/internal/") {
			continue
		}
		name := path[strings.LastIndexByte(path, '/')+1:]
		if imp.Name != nil {
			name = imp.Name.Name
		}
		internal[name] = true
	}
	if len(internal) == 0 {
		return nil
	}
	names := func(e ast.Node) bool {
		found := false
		ast.Inspect(e, func(n ast.Node) bool {
			if sel, ok := n.(*ast.SelectorExpr); ok {
				if id, ok := sel.X.(*ast.Ident); ok && internal[id.Name] {
					found = true
				}
			}
			return !found
		})
		return found
	}
	var out []string
	for _, decl := range f.Decls {
		switch d := decl.(type) {
		case *ast.FuncDecl:
			if !d.Name.IsExported() || d.Recv != nil && !exportedReceiver(d.Recv) {
				continue
			}
			if names(d.Type) {
				out = append(out, d.Name.Name)
			}
		case *ast.GenDecl:
			for _, spec := range d.Specs {
				switch s := spec.(type) {
				case *ast.TypeSpec:
					if s.Name.IsExported() && exposes(s.Type, names) {
						out = append(out, s.Name.Name)
					}
				case *ast.ValueSpec:
					for _, n := range s.Names {
						if n.IsExported() && s.Type != nil && names(s.Type) {
							out = append(out, n.Name)
						}
					}
				}
			}
		}
	}
	return out
}

// exposes reports whether a type's exported parts name an internal type:
// the type itself, or an exported field or method of a struct or
// interface.
func exposes(typ ast.Expr, names func(ast.Node) bool) bool {
	var fields *ast.FieldList
	switch x := typ.(type) {
	case *ast.StructType:
		fields = x.Fields
	case *ast.InterfaceType:
		fields = x.Methods
	default:
		return names(typ)
	}
	for _, field := range fields.List {
		exported := len(field.Names) == 0 // embedded: its methods are promoted
		for _, n := range field.Names {
			exported = exported || n.IsExported()
		}
		if exported && names(field.Type) {
			return true
		}
	}
	return false
}

func exportedReceiver(recv *ast.FieldList) bool {
	typ := recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	if idx, ok := typ.(*ast.IndexExpr); ok {
		typ = idx.X
	}
	id, ok := typ.(*ast.Ident)
	return ok && id.IsExported()
}
