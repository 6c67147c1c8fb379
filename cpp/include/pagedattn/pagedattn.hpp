// Umbrella header of the pagedattn C++ core.
#pragma once

#include "pagedattn/attention.hpp"
#include "pagedattn/block_manager.hpp"
#include "pagedattn/cache_ops.hpp"
#include "pagedattn/errors.hpp"
#include "pagedattn/fp8.hpp"
#include "pagedattn/supported.hpp"
#include "pagedattn/tensor.hpp"
#include "pagedattn/version.hpp"
