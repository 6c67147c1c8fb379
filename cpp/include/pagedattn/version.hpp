#pragma once

#define PAGEDATTN_VERSION_MAJOR 0
#define PAGEDATTN_VERSION_MINOR 1
#define PAGEDATTN_VERSION_PATCH 0

namespace pagedattn {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace pagedattn
