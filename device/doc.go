// Package device names the places where tensor memory lives and says
// which place new tensors go to.
//
// A Place is a small comparable value: CPU(), GPU(i), or a device of a kind
// registered at run time with RegisterType ("my_npu:0"). Parse reads the
// text form users write.
//
// The current place has two layers, after Paddle's thread-safe device
// design. Layer one is the process default (SetDefault, Default), one
// atomic word read without a lock. Layer two is a scope carried by a
// context.Context (With, Current): code that runs with a scoped context
// sees the scope's place, code whose context carries none sees the process
// default. Scopes are immutable values, so goroutines never see each
// other's places and leaving a scope, by return or by panic, needs no
// restoring. Do is the "with place:" block and Bind the decorator.
//
// The package owns no resources; the type registry is guarded and may be
// extended at any time.
package device
