//go:build cgo && linux

package cuda

import "testing"

// TestEverySlotHasASymbolName: a slot of the function table without a
// name would make openLibcuda fail on every machine that has a driver.
func TestEverySlotHasASymbolName(t *testing.T) {
	for slot, names := range symbols {
		if len(names) == 0 {
			t.Errorf("driver slot %d has no symbol name", slot)
		}
	}
}
