// js-libp2p 3 calls Promise.withResolvers (node >= 22); node 20, what Debian-based machines here carry, lacks it.
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function withResolvers () {
    let resolve, reject
    const promise = new this((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}
