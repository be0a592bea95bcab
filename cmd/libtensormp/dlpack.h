/*
 * DLPack's exchange structures (DLPack 0.8, the unversioned
 * DLManagedTensor that torch.from_dlpack and numpy.from_dlpack take),
 * written out for libtensormp's C interface.
 */
#ifndef TENSORMP_DLPACK_H
#define TENSORMP_DLPACK_H

#include <stdint.h>

enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 };
enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLComplex = 5, kDLBool = 6 };

typedef struct {
	int32_t device_type;
	int32_t device_id;
} DLDevice;

typedef struct {
	uint8_t code;
	uint8_t bits;
	uint16_t lanes;
} DLDataType;

typedef struct {
	void *data;
	DLDevice device;
	int32_t ndim;
	DLDataType dtype;
	int64_t *shape;
	int64_t *strides; /* in elements; NULL means compact row-major */
	uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
	DLTensor dl_tensor;
	void *manager_ctx;
	void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#endif
