#include "textflag.h"

// func prefetchw(p unsafe.Pointer)
TEXT ·prefetchw(SB), NOSPLIT, $0-8
	MOVQ p+0(FP), AX
	BYTE $0x0F; BYTE $0x0D; BYTE $0x08 // PREFETCHW (AX)
	RET

// func prefetcht0(p unsafe.Pointer)
TEXT ·prefetcht0(SB), NOSPLIT, $0-8
	MOVQ p+0(FP), AX
	PREFETCHT0 (AX)
	RET

// func prefetchwLines(p unsafe.Pointer, n uintptr)
TEXT ·prefetchwLines(SB), NOSPLIT, $0-16
	MOVQ p+0(FP), AX
	MOVQ n+8(FP), CX
	TESTQ CX, CX
	JZ done
loop:
	BYTE $0x0F; BYTE $0x0D; BYTE $0x08 // PREFETCHW (AX)
	ADDQ $64, AX
	DECQ CX
	JNZ loop
done:
	RET
