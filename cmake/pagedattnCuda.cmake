# Decides whether the CUDA backend is built and sets up the CUDA language.
#   PAGEDATTN_CUDA=AUTO  build it when a CUDA compiler is found
#   PAGEDATTN_CUDA=ON    require it
#   PAGEDATTN_CUDA=OFF   CPU only
# Target GPUs come from CMAKE_CUDA_ARCHITECTURES; when unset we build for the
# architectures in PAGEDATTN_DEFAULT_CUDA_ARCHS (Ampere and Hopper machine code).

set(PAGEDATTN_DEFAULT_CUDA_ARCHS "80;90")
set(PAGEDATTN_WITH_CUDA OFF)

string(TOUPPER "${PAGEDATTN_CUDA}" _pa_cuda)
if(NOT _pa_cuda STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
      set(CMAKE_CUDA_ARCHITECTURES ${PAGEDATTN_DEFAULT_CUDA_ARCHS})
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(PAGEDATTN_WITH_CUDA ON)
  elseif(_pa_cuda STREQUAL "ON")
    message(FATAL_ERROR "PAGEDATTN_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER or put nvcc on PATH)")
  endif()
endif()
message(STATUS "pagedattn: CUDA backend ${PAGEDATTN_WITH_CUDA} (architectures: ${CMAKE_CUDA_ARCHITECTURES})")

function(pagedattn_configure_cuda_target tgt)
  set_target_properties(${tgt} PROPERTIES
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_RUNTIME_LIBRARY Static)
  target_compile_definitions(${tgt} PUBLIC PAGEDATTN_WITH_CUDA=1)
  target_compile_options(${tgt} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
  target_link_libraries(${tgt} PRIVATE CUDA::cudart_static)
endfunction()
