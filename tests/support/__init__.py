"""Fixtures the tests share with the benchmarks: a server as a child process, tiny random models.

The one copy lives here, under tests/, because the tests are their main users and the
package must not ship them. Benchmarks that start servers or build tiny models (four-way,
soak, scale-out, schedule, programs, responsiveness) import them too, from a source
checkout. So this package stays a leaf: it imports radixserve and third-party libraries
only, never pytest, the rest of tests/ or benchmarks/.
"""
