package main

import (
	"strings"

	"github.com/tensormp/tensormp/strategy"
)

// strategyList is a flag of comma-separated sharing strategies, every one
// by default.
type strategyList []strategy.Strategy

func (l *strategyList) String() string {
	names := make([]string, len(*l))
	for i, st := range *l {
		names[i] = st.String()
	}
	return strings.Join(names, ",")
}

func (l *strategyList) Set(v string) error {
	var sts []strategy.Strategy
	for _, name := range strings.Split(v, ",") {
		st, err := strategy.Parse(strings.TrimSpace(name))
		if err != nil {
			return err
		}
		sts = append(sts, st)
	}
	*l = sts
	return nil
}
