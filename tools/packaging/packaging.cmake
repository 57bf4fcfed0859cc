# Installing and packaging: the man pages (scdoc), the systemd unit with the install prefix's
# paths, the sysctl.d drop-in for the UDP receive buffer, the package's documentation, and the
# Debian package (CPack DEB):
#
#   cmake -S . -B build && cmake --build build -j && (cd build && cpack -G DEB)
#
# makes build/bucketd_<version>-1_amd64.deb; the same in a build configured with
# tools/aarch64-toolchain.cmake makes the arm64 one. The package's files are the install rules
# below and CMakeLists.txt's (binaries, config): the same as `cmake --install`, with the prefix
# /usr. packaging/ holds the maintainer scripts and the Debian files; tools/test-packages.sh
# builds, lints and installs both packages.

# --- Man pages -------------------------------------------------------------------------------

option(BD_MAN "Build and install the man pages (needs scdoc)" ON)
set(BD_MAN_PAGES bucketd.8 bucketd.yaml.5 bucketd-metrics.7 bucketd-schema.7 bucketd-parse.1
                 bucketd-inspect.1 bucketd-sim.1)
if(BD_MAN)
  find_program(BD_SCDOC scdoc)
  find_program(BD_PYTHON3 python3)
  if(NOT BD_SCDOC OR NOT BD_PYTHON3)
    # Not fatal, so that a build for the tests or the benchmarks needs no scdoc; a package made
    # without the pages fails tools/test-packages.sh (and lintian).
    message(WARNING "scdoc or python3 not found: building without the man pages "
                    "(tools/install-deps.sh installs scdoc)")
    set(BD_MAN OFF)
  endif()
endif()
if(BD_MAN)
  set(BD_MAN_OUTPUTS "")
  foreach(page ${BD_MAN_PAGES})
    string(REGEX REPLACE ".*\\.([0-9])$" "\\1" section ${page})
    set(out ${CMAKE_BINARY_DIR}/man/${page})
    # tools/man/build-man.py: scdoc source -> roff (and .gz), the version put in.
    add_custom_command(
      OUTPUT ${out} ${out}.gz
      COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/man
      COMMAND ${CMAKE_COMMAND} -E env SCDOC=${BD_SCDOC} ${BD_PYTHON3}
              ${CMAKE_SOURCE_DIR}/tools/man/build-man.py ${CMAKE_SOURCE_DIR}/tools/man/${page}.scd
              ${PROJECT_VERSION} ${out}
      DEPENDS ${CMAKE_SOURCE_DIR}/tools/man/${page}.scd ${CMAKE_SOURCE_DIR}/tools/man/build-man.py
      COMMENT "Man page ${page}"
      VERBATIM)
    list(APPEND BD_MAN_OUTPUTS ${out} ${out}.gz)
    install(FILES ${out}.gz DESTINATION share/man/man${section})
  endforeach()
  add_custom_target(man ALL DEPENDS ${BD_MAN_OUTPUTS})
endif()

# --- The systemd unit, the sysctl.d drop-in, documentation ----------------------------------

# systemd/bucketd.service names /usr/local/bin, the default prefix; it is installed with the
# prefix it is installed under (/usr in the package). Debian bookworm's units live in
# /lib/systemd/system; under another prefix, <prefix>/lib/systemd/system (systemd also reads
# /usr/local/lib/systemd/system).
install(CODE "
  set(_bd_unit_dir \"\${CMAKE_INSTALL_PREFIX}/lib/systemd/system\")
  if(CMAKE_INSTALL_PREFIX STREQUAL \"/usr\")
    set(_bd_unit_dir /lib/systemd/system)
  endif()
  file(READ \"${CMAKE_SOURCE_DIR}/systemd/bucketd.service\" _bd_unit)
  string(REPLACE \"/usr/local/bin/\" \"\${CMAKE_INSTALL_PREFIX}/bin/\" _bd_unit \"\${_bd_unit}\")
  file(WRITE \"${CMAKE_BINARY_DIR}/install/bucketd.service\" \"\${_bd_unit}\")
  file(INSTALL \"${CMAKE_BINARY_DIR}/install/bucketd.service\" DESTINATION \"\${_bd_unit_dir}\"
       PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
")

# net.core.rmem_max for the default UDP receive buffer (listeners[].rcvbuf, 8 MiB): without
# CAP_NET_ADMIN, which the unit does not grant, the kernel caps SO_RCVBUF at that sysctl (Debian's
# default: 212992 bytes). systemd-sysctl reads <prefix>/lib/sysctl.d (/usr/lib/sysctl.d in the
# package, /usr/local/lib/sysctl.d by default) at boot; the package's postinst applies it at once.
set(BD_RMEM_MAX 8388608)
configure_file(${CMAKE_SOURCE_DIR}/tools/packaging/60-bucketd.conf.in
               ${CMAKE_BINARY_DIR}/install/60-bucketd.conf @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/install/60-bucketd.conf DESTINATION lib/sysctl.d)

# The service's user and group (systemd-sysusers reads <prefix>/lib/sysusers.d; under /usr/local
# too). A `cmake --install` as root creates them at once, so that the config can be given to
# group bucketd (CMakeLists.txt); the package's postinst does the same.
install(FILES tools/packaging/bucketd.sysusers DESTINATION lib/sysusers.d RENAME bucketd.conf)
install(CODE "
  if(\"\$ENV{DESTDIR}\" STREQUAL \"\")
    find_program(_bd_sysusers systemd-sysusers)
    if(_bd_sysusers)
      execute_process(COMMAND \${_bd_sysusers}
                              \"\${CMAKE_INSTALL_PREFIX}/lib/sysusers.d/bucketd.conf\"
                      RESULT_VARIABLE _bd_rc ERROR_QUIET)
    endif()
  endif()
")

install(FILES README.md tools/packaging/copyright DESTINATION share/doc/bucketd)
# The monitoring files (README, "Alerts and a Grafana dashboard"): data for Prometheus and
# Grafana, not documentation, so beside the package's other data rather than under doc/.
install(FILES config/prometheus/bucketd-rules.yml config/grafana/bucketd-dashboard.json
        DESTINATION share/bucketd)
# The IPAddressAllow=/IPAddressDeny= drop-in, as an example to copy to
# /etc/systemd/system/bucketd.service.d/ (never installed where systemd would read it: the
# prefixes are the operator's).
install(FILES systemd/bucketd-allow.conf.example
        DESTINATION share/doc/bucketd/examples/bucketd.service.d RENAME allow.conf)

# --- The Debian package --------------------------------------------------------------------

set(CPACK_PACKAGE_NAME bucketd)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "bucketd maintainers <maintainers@bucketd.example>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "time-series ingestion daemon: sensor readings into MongoDB buckets")
# The extended description; CPack puts the summary first and indents every line ("." is an
# empty line).
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "bucketd receives sensor readings as UDP datagrams or TCP line streams in
InfluxDB line protocol or Graphite plaintext and stores them in MongoDB with
the bucket pattern: one document per sensor per time bucket, with running
min/max/sum/count/avg summaries per field, written in batches. While MongoDB
is away, batches go to an on-disk spool and are written exactly once later.
.
The package holds the daemon, its systemd unit (installed neither enabled nor
started), its configuration in /etc/bucketd, a sysctl.d drop-in for the UDP
receive buffer, the tools bucketd-inspect, bucketd-parse and bucketd-sim, and
Prometheus alerting rules and a Grafana dashboard in /usr/share/bucketd.")
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT) # bucketd_<version>-1_<arch>.deb
# Depends: dpkg-shlibdeps on the binaries (the libraries' symbols files give the versions), and
# procps for /bin/kill, which the unit's ExecReload runs (systemctl reload sends SIGHUP with it).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "procps")
set(CPACK_STRIP_FILES ON)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_DEBIAN_COMPRESSION_TYPE xz)

set(BD_DEB_CONTROL ${CMAKE_BINARY_DIR}/debian-control)
foreach(script postinst prerm postrm)
  configure_file(${CMAKE_SOURCE_DIR}/tools/packaging/${script}.in ${BD_DEB_CONTROL}/${script} @ONLY)
endforeach()
configure_file(${CMAKE_SOURCE_DIR}/tools/packaging/conffiles ${BD_DEB_CONTROL}/conffiles COPYONLY)
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${BD_DEB_CONTROL}/conffiles ${BD_DEB_CONTROL}/postinst ${BD_DEB_CONTROL}/prerm
    ${BD_DEB_CONTROL}/postrm)

# Debian's changelog (policy: /usr/share/doc/<package>/changelog.Debian.gz) and the lintian
# overrides (each justified in tools/packaging/bucketd.lintian-overrides): files of the Debian package
# only, installed when the prefix is /usr. gzip -9n: no name or time stamp in the header.
configure_file(${CMAKE_SOURCE_DIR}/tools/packaging/changelog.Debian.in
               ${CMAKE_BINARY_DIR}/install/changelog.Debian @ONLY)
find_program(BD_GZIP gzip REQUIRED)
execute_process(COMMAND ${BD_GZIP} -9nc INPUT_FILE ${CMAKE_BINARY_DIR}/install/changelog.Debian
                OUTPUT_FILE ${CMAKE_BINARY_DIR}/install/changelog.Debian.gz RESULT_VARIABLE _bd_rc)
if(NOT _bd_rc EQUAL 0)
  message(FATAL_ERROR "gzip of changelog.Debian failed")
endif()
install(CODE "
  if(CMAKE_INSTALL_PREFIX STREQUAL \"/usr\")
    file(INSTALL \"${CMAKE_BINARY_DIR}/install/changelog.Debian.gz\"
         DESTINATION /usr/share/doc/bucketd)
    file(INSTALL \"${CMAKE_SOURCE_DIR}/tools/packaging/bucketd.lintian-overrides\"
         DESTINATION /usr/share/lintian/overrides RENAME bucketd)
  endif()
")

# A cross build (tools/aarch64-toolchain.cmake) makes the arm64 package. dpkg-shlibdeps finds
# the arm64 libraries in the unpacked packages of BD_AARCH64_SYSROOT, with the symbols and shlibs
# files that tools/test-aarch64.sh collects in its DEBIAN/ directory.
if(CMAKE_CROSSCOMPILING)
  if(CMAKE_SYSTEM_PROCESSOR STREQUAL "aarch64")
    set(CPACK_DEBIAN_PACKAGE_ARCHITECTURE arm64)
  endif()
  if(BD_AARCH64_SYSROOT)
    set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS
        ${BD_AARCH64_SYSROOT}/usr/lib/aarch64-linux-gnu ${BD_AARCH64_SYSROOT}/lib/aarch64-linux-gnu
        ${BD_AARCH64_SYSROOT}/lib)
  endif()
endif()
if(CPACK_DEBIAN_PACKAGE_ARCHITECTURE)
  # dpkg-shlibdeps reads the host architecture from the environment.
  file(WRITE ${CMAKE_BINARY_DIR}/CPackProjectConfig.cmake
       "set(ENV{DEB_HOST_ARCH} ${CPACK_DEBIAN_PACKAGE_ARCHITECTURE})\n")
  set(CPACK_PROJECT_CONFIG_FILE ${CMAKE_BINARY_DIR}/CPackProjectConfig.cmake)
endif()

set(CPACK_GENERATOR DEB)
include(CPack)
