# Cross-building bucketd for aarch64 (arm64) on a Debian amd64 machine: Debian's cross compiler
# (gcc-aarch64-linux-gnu, with its own arm64 C library) and the arm64 -dev packages unpacked into
# a private directory, BD_AARCH64_SYSROOT (the cache variable or the environment variable). The
# packages are unpacked rather than installed because libmongoc-dev and libbson-dev cannot be
# installed for two architectures at once: installing the arm64 ones would remove the machine's
# own. tools/test-aarch64.sh sets it all up and runs the tests. By hand:
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=tools/aarch64-toolchain.cmake \
#       -DBD_AARCH64_SYSROOT=/path/to/unpacked/packages
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)

if(NOT BD_AARCH64_SYSROOT)
  set(BD_AARCH64_SYSROOT "$ENV{BD_AARCH64_SYSROOT}")
endif()
if(NOT IS_DIRECTORY "${BD_AARCH64_SYSROOT}/usr/lib/aarch64-linux-gnu")
  message(FATAL_ERROR "BD_AARCH64_SYSROOT (${BD_AARCH64_SYSROOT}) holds no arm64 libraries")
endif()
set(BD_AARCH64_SYSROOT "${BD_AARCH64_SYSROOT}" CACHE PATH "unpacked arm64 packages")

# pkg-config reads the unpacked .pc files and prefixes their paths with the directory; never
# the build machine's own.
set(ENV{PKG_CONFIG_SYSROOT_DIR} "${BD_AARCH64_SYSROOT}")
set(ENV{PKG_CONFIG_LIBDIR}
    "${BD_AARCH64_SYSROOT}/usr/lib/aarch64-linux-gnu/pkgconfig:${BD_AARCH64_SYSROOT}/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")

# The libraries' own dependencies (libssl, libicu, ...) are found there at link time too.
# Debian's multiarch headers (openssl/opensslconf.h, ffi.h) live under the triplet directory,
# which the cross compiler does not search in an unpacked root: searched after the -I
# directories pkg-config gives.
string(APPEND CMAKE_C_FLAGS_INIT " -isystem ${BD_AARCH64_SYSROOT}/usr/include/aarch64-linux-gnu")

set(_bd_libdirs "${BD_AARCH64_SYSROOT}/usr/lib/aarch64-linux-gnu"
    "${BD_AARCH64_SYSROOT}/lib/aarch64-linux-gnu")
set(CMAKE_EXE_LINKER_FLAGS_INIT "")
foreach(dir ${_bd_libdirs})
  string(APPEND CMAKE_EXE_LINKER_FLAGS_INIT " -L${dir} -Wl,-rpath-link,${dir}")
endforeach()
