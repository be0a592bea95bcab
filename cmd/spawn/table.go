package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// table prints rows in aligned columns, its header first. Call flush once
// every row is written.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)}
	t.row(header...)
	return t
}

// row writes one row, a cell per column.
func (t *table) row(cells ...string) { fmt.Fprintln(t.tw, strings.Join(cells, "\t")) }

func (t *table) flush() { _ = t.tw.Flush() }

// deviceOf names where a result's tensors were: its device, or the CPU.
func deviceOf(r benchResult) string {
	if r.Device == "" {
		return "cpu"
	}
	return r.Device
}
