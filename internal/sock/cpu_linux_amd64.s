#include "textflag.h"

// func rdpid() uint32
TEXT ·rdpid(SB), NOSPLIT, $0-4
	BYTE $0xF3; BYTE $0x0F; BYTE $0xC7; BYTE $0xF8 // RDPID RAX
	MOVL AX, ret+0(FP)
	RET

// func rdtscpAux() uint32
TEXT ·rdtscpAux(SB), NOSPLIT, $0-4
	RDTSCP
	MOVL CX, ret+0(FP)
	RET
