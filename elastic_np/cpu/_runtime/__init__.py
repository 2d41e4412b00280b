"""How the CPU kernels run: their tunables, Numba's private paths and cache, the thread pool, kept scratch.

Modules: ``config`` (every tunable), ``numba_private`` (every use of Numba's
internals, and the kernels' cache folder), ``threads`` (the pool and each
thread's share of the tasks), ``openmp`` (asking other libraries' OpenMP
workers to sleep), ``scratch`` (arrays kept between calls). Nothing is
imported here: `elastic_np.cpu` imports the modules that make cached
functions inside `numba_private.own_cache`.
"""
