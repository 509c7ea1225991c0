# Fix-ups for building against the ROS 2 wheels from PyPI (not used on a real ROS install).
# The wheels were built in manylinux containers, so their exported *__rosidl_generator_py targets name
# include directories under /opt/python/... that do not exist here: point every such imported target at
# this interpreter's Python and NumPy headers instead. Include this file after rosidl_generate_interfaces
# (target properties are read at generate time, and the generator finds transitive deps itself).
find_package(Python3 REQUIRED COMPONENTS Interpreter Development NumPy)
get_property(_flashrt_imported DIRECTORY PROPERTY IMPORTED_TARGETS)
foreach(tgt IN LISTS _flashrt_imported)
  if(tgt MATCHES "__rosidl_generator_py$")
    set_target_properties(${tgt} PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${Python3_INCLUDE_DIRS};${Python3_NumPy_INCLUDE_DIRS}")
  endif()
endforeach()
