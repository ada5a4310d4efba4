// Emulation stand-in for the CUDA header of this name: everything the project's kernel
// sources use comes from cuda_emulation.h (see there).
#pragma once
#include "../cuda_emulation.h"
