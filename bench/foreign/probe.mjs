// A js-libp2p stranger (TCP, Noise, Yamux; never joins) that opens each protocol it is given on one hub, sends a
// frame header claiming a huge body and then garbage, half-closes, and waits for the hub to end each stream and
// the connection. bench/foreign_peer.py runs it; it prints one JSON object on stdout.
//
// Usage: node probe.mjs '{"hub": "/ip4/127.0.0.1/tcp/N/p2p/12D3...", "give_up_s": 150, "garbage_bytes": 1048576,
//                          "pattern": "pieces" (64 KiB sends, with back-pressure) or "one-write" (one send),
//                          "protocols": [{"protocol": "/echo2/join/1", "header_hex": "01ffffffff"}, ...],
//                          "busy": {"protocol": "/echo2/status/1", "header_hex": "0dffffffff", "every_s": 1} or null}'
import './node20.mjs'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { tcp } from '@libp2p/tcp'
import { multiaddr } from '@multiformats/multiaddr'
import { createLibp2p } from 'libp2p'

const args = JSON.parse(process.argv[2])
const giveUpMs = args.give_up_s * 1000
const garbage = new Uint8Array(args.garbage_bytes).fill(0xa5)
const since = (t0) => (Date.now() - t0) / 1000

// Nothing of our side may end a stream or the connection before the hub does: no pings, no inactivity timeouts.
const node = await createLibp2p({
  transports: [tcp({ outboundSocketInactivityTimeout: 2 * giveUpMs })],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux({ streamOptions: { inactivityTimeout: 2 * giveUpMs } })],
  connectionMonitor: { enabled: false }
})
await node.start()

const start = Date.now()
const connection = await node.dial(multiaddr(args.hub))
const connected_s = since(start)
let connectionClosedS = null
node.addEventListener('connection:close', (evt) => {
  if (evt.detail.id === connection.id && connectionClosedS === null) connectionClosedS = since(start)
})

// Sends the bad frame with the stream's back-pressure; false if the hub ended the stream first.
async function sendAll (stream, bytes, chunkBytes = 64 * 1024) {
  for (let at = 0; at < bytes.length; at += chunkBytes) {
    if (stream.writeStatus !== 'writable' || stream.status !== 'open') return false
    if (!stream.send(bytes.subarray(at, at + chunkBytes))) await stream.onDrain()
  }
  return true
}

async function probe ({ protocol, header_hex: headerHex }) {
  const header = Uint8Array.from(Buffer.from(headerHex, 'hex'))
  const result = { protocol, opened_s: null, sent: false, half_closed_s: null, reply_bytes: 0, reply_head: '', ended_by: null, ended_s: null, error: null }
  try {
    const stream = await connection.newStream(protocol, { signal: AbortSignal.timeout(10_000) })
    result.opened_s = since(start)
    const ended = new Promise((resolve) => {
      stream.addEventListener('close', (evt) => {
        result.ended_s = since(start)
        result.ended_by = evt.error == null ? 'closed' : (evt.local ? 'local abort' : `reset (${evt.error.name})`)
        resolve()
      })
    })
    stream.addEventListener('message', (evt) => {
      const data = evt.data.subarray()
      if (result.reply_bytes < 200) result.reply_head += Buffer.from(data.subarray(0, 200)).toString('latin1')
      result.reply_bytes += data.byteLength
    })
    try {
      if (args.pattern === 'one-write') {
        // The whole message in one send, whatever the stream's back-pressure says; close() waits for it to drain.
        const message = new Uint8Array(header.byteLength + garbage.byteLength)
        message.set(header)
        message.set(garbage, header.byteLength)
        stream.send(message)
        result.sent = true
      } else {
        result.sent = (await sendAll(stream, header)) && (await sendAll(stream, garbage))
      }
      if (result.sent) {
        await stream.close({ signal: AbortSignal.timeout(giveUpMs) })
        result.half_closed_s = since(start)
      }
    } catch (err) {
      result.error = `${err.name}: ${err.message}`
    }
    const gaveUp = new Promise((resolve) => setTimeout(resolve, Math.max(0, giveUpMs - (Date.now() - start))))
    await Promise.race([ended, gaveUp])
    if (result.ended_s === null) {
      result.ended_by = 'still open when the probe gave up'
      stream.abort(new Error('probe gave up'))
    }
  } catch (err) {
    result.error = `${err.name}: ${err.message}`
  }
  return result
}

const streams = await Promise.all(args.protocols.map(probe))
// The connection may outlive every stream: wait for it until the probe's own deadline, with `busy` opening one
// more bad stream every `every_s` meanwhile (a stranger that is never idle).
let busyStreams = 0
let nextBusy = Date.now()
while (connectionClosedS === null && Date.now() - start < giveUpMs) {
  if (args.busy != null && Date.now() >= nextBusy) {
    nextBusy += args.busy.every_s * 1000
    busyStreams += 1
    probe(args.busy).catch(() => {})
  }
  await new Promise((resolve) => setTimeout(resolve, 100))
}
const report = {
  implementation: 'js-libp2p',
  connected_s,
  connection_closed_s: connectionClosedS,
  connection_status: connection.status,
  give_up_s: args.give_up_s,
  busy_streams: busyStreams,
  streams
}
await node.stop()
process.stdout.write(JSON.stringify(report) + '\n')
process.exit(0)
