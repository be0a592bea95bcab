package apileak

import "github.com/tensormp/tensormp/internal/shm"

type pool = shm.Pool
