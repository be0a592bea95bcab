package session_test

import (
	"testing"

	"github.com/tensormp/tensormp/internal/testmain"
)

func TestMain(m *testing.M) { testmain.Run(m) }
