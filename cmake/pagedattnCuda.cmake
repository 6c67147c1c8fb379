# Decides whether the CUDA backend is built and sets up the CUDA language.
#   PAGEDATTN_CUDA=AUTO  build it when a CUDA compiler is found
#   PAGEDATTN_CUDA=ON    require it
#   PAGEDATTN_CUDA=OFF   CPU only
#
# Target GPUs, first match wins:
#   1. CMAKE_CUDA_ARCHITECTURES (-DCMAKE_CUDA_ARCHITECTURES=90, or
#      -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90 through pip);
#   2. the CUDAARCHS environment variable (CMake's own);
#   3. the GPUs of this machine, as nvidia-smi reports them (machine code for each);
#   4. PAGEDATTN_DEFAULT_CUDA_ARCHS: machine code for sm_80 (A100, and through binary
#      compatibility A10 / L4 / RTX 30xx / 40xx) and sm_90 (H100 / H200), plus compute_90
#      PTX, which the driver compiles for newer GPUs.

set(PAGEDATTN_DEFAULT_CUDA_ARCHS "80-real;90")
option(PAGEDATTN_CUDA_LINEINFO "Keep CUDA source line information (for Nsight Compute's source view)" OFF)
set(PAGEDATTN_WITH_CUDA OFF)

# The compute capabilities of the GPUs nvidia-smi sees, as "80-real;90-real", or "".
function(pagedattn_detect_gpu_archs out)
  set(archs "")
  find_program(PAGEDATTN_NVIDIA_SMI nvidia-smi)
  mark_as_advanced(PAGEDATTN_NVIDIA_SMI)
  if(PAGEDATTN_NVIDIA_SMI)
    execute_process(COMMAND ${PAGEDATTN_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET TIMEOUT 20)
    if(rc EQUAL 0)
      string(REPLACE "\n" ";" caps "${caps}")
      foreach(cap IN LISTS caps)
        string(STRIP "${cap}" cap)
        if(cap MATCHES "^([0-9]+)\\.([0-9]+)$")
          list(APPEND archs "${CMAKE_MATCH_1}${CMAKE_MATCH_2}-real")
        endif()
      endforeach()
      list(REMOVE_DUPLICATES archs)
    endif()
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
endfunction()

string(TOUPPER "${PAGEDATTN_CUDA}" _pa_cuda)
if(NOT _pa_cuda STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT CMAKE_CUDA_ARCHITECTURES STREQUAL "")
      set(PAGEDATTN_CUDA_ARCHS_FROM "CMAKE_CUDA_ARCHITECTURES")
    elseif(NOT "$ENV{CUDAARCHS}" STREQUAL "")
      set(CMAKE_CUDA_ARCHITECTURES "$ENV{CUDAARCHS}")
      set(PAGEDATTN_CUDA_ARCHS_FROM "the CUDAARCHS environment variable")
    else()
      pagedattn_detect_gpu_archs(_pa_found)
      if(_pa_found)
        set(CMAKE_CUDA_ARCHITECTURES "${_pa_found}")
        set(PAGEDATTN_CUDA_ARCHS_FROM "the GPUs of this machine")
      else()
        set(CMAKE_CUDA_ARCHITECTURES "${PAGEDATTN_DEFAULT_CUDA_ARCHS}")
        set(PAGEDATTN_CUDA_ARCHS_FROM "the default list; no GPU seen")
      endif()
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(PAGEDATTN_WITH_CUDA ON)
  elseif(_pa_cuda STREQUAL "ON")
    message(FATAL_ERROR "PAGEDATTN_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER or put nvcc on PATH)")
  endif()
endif()
if(PAGEDATTN_WITH_CUDA)
  message(STATUS "pagedattn: CUDA backend ON, architectures ${CMAKE_CUDA_ARCHITECTURES} "
                 "(from ${PAGEDATTN_CUDA_ARCHS_FROM})")
else()
  message(STATUS "pagedattn: CUDA backend OFF (CPU only)")
endif()

# Prints what the CUDA part of the build costs, before it starts: the number of kernel
# files and a rough time, with the way to skip it.
function(pagedattn_report_cuda_build sources_var)
  list(LENGTH ${sources_var} n_files)
  set(n_archs 0)
  foreach(a IN LISTS CMAKE_CUDA_ARCHITECTURES)
    math(EXPR n_archs "${n_archs} + 1")
  endforeach()
  cmake_host_system_information(RESULT cores QUERY NUMBER_OF_PHYSICAL_CORES)
  if(NOT cores OR cores LESS 1)
    set(cores 1)
  endif()
  # About 280 s of one core per entry of CMAKE_CUDA_ARCHITECTURES for all kernel files
  # (nvcc 13.0, x86-64; the default list took 8 min on a shared 2-core machine), shared
  # by the cores.
  math(EXPR minutes "(280 * ${n_archs} + 60 * ${cores} - 1) / (60 * ${cores})")
  message(STATUS "pagedattn: compiling ${n_files} CUDA files for ${n_archs} architecture(s): "
                 "about ${minutes} min on ${cores} idle core(s). CPU only: -DPAGEDATTN_CUDA=OFF "
                 "(pip: -Ccmake.define.PAGEDATTN_CUDA=OFF); one GPU: -DCMAKE_CUDA_ARCHITECTURES=90")
endfunction()

function(pagedattn_configure_cuda_target tgt)
  set_target_properties(${tgt} PROPERTIES
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_RUNTIME_LIBRARY Static)
  target_compile_definitions(${tgt} PUBLIC PAGEDATTN_WITH_CUDA=1)
  target_compile_options(${tgt} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  if(PAGEDATTN_CUDA_LINEINFO)
    target_compile_options(${tgt} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
  endif()
  # Smallest fat binaries (nvcc 12.8+): the kernels are decompressed once, when the
  # module loads.
  if(CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA" AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.8)
    target_compile_options(${tgt} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--compress-mode=size>)
  endif()
  target_link_libraries(${tgt} PRIVATE CUDA::cudart_static)
endfunction()

# The Hopper kernels of cuda/sm90/ use sm_90a instructions (wgmma), which exist only in
# machine code for exactly that target: they are compiled in an object library of their
# own with -gencode arch=compute_90a,code=sm_90a (CUDA_ARCHITECTURES OFF: no other
# target) and linked into `tgt`, which then selects them at run time on compute
# capability 9.0 (PAGEDATTN_SM90_PREFILL=1). Only when CMAKE_CUDA_ARCHITECTURES names
# 90 in some form (90, 90-real, 90a, ...): a build for other GPUs skips them.
function(pagedattn_add_sm90_kernels tgt root)
  set(want OFF)
  foreach(a IN LISTS CMAKE_CUDA_ARCHITECTURES)
    if(a MATCHES "^90")
      set(want ON)
    endif()
  endforeach()
  if(NOT want)
    message(STATUS "pagedattn: Hopper (sm_90a) varlen kernels OFF (no 90 in CMAKE_CUDA_ARCHITECTURES)")
    return()
  endif()
  message(STATUS "pagedattn: Hopper (sm_90a) varlen kernels ON")
  file(GLOB sources CONFIGURE_DEPENDS "${root}/cuda/sm90/*.cu")
  add_library(${tgt}_sm90 OBJECT ${sources})
  set_target_properties(${tgt}_sm90 PROPERTIES
    CUDA_ARCHITECTURES OFF
    POSITION_INDEPENDENT_CODE ON
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    CUDA_RUNTIME_LIBRARY Static)
  target_include_directories(${tgt}_sm90 PRIVATE ${root} ${root}/cpp/src ${root}/cpp/include)
  target_compile_definitions(${tgt}_sm90 PRIVATE PAGEDATTN_WITH_CUDA=1)
  target_compile_options(${tgt}_sm90 PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a>)
  if(PAGEDATTN_CUDA_LINEINFO)
    target_compile_options(${tgt}_sm90 PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
  endif()
  if(CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA" AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.8)
    target_compile_options(${tgt}_sm90 PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--compress-mode=size>)
  endif()
  target_sources(${tgt} PRIVATE $<TARGET_OBJECTS:${tgt}_sm90>)
  target_compile_definitions(${tgt} PRIVATE PAGEDATTN_SM90_PREFILL=1)
endfunction()
