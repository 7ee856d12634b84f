// Rendering a parsed chat template (chat_template.h) with Jinja2's and Python's semantics: values
// are JSON data, Jinja's Undefined, or a namespace() object (shared, so `set ns.x` is seen by
// every holder); `for` opens a scope that `set` cannot leave, `if` does not.

#include "chat_template_ast.h"
#include "chat_template_values.h"
#include "difftrain/core/error.h"

#include <unordered_map>

namespace difftrain::models {

namespace jinja {

namespace {

using values::to_str;
using values::truthy;
using values::type_name;

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  Renderer(const ChatTemplate::Impl& t, const Json& variables) : t_(t) {
    frames_.emplace_back();
    for (const auto& [key, value] : variables.items()) frames_.back()[key] = Value::data(value);
  }

  std::string run() {
    std::string out;
    exec(t_.body, out);
    return out;
  }

 private:
  [[noreturn]] void fail(int line, const std::string& what) const {
    throw Error(t_.origin + ": chat template line " + std::to_string(line) + ": " + what);
  }

  Flow exec(const Body& body, std::string& out) {
    for (const auto& s : body) {
      const Flow flow = exec_one(*s, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec_one(const Stmt& s, std::string& out) {
    switch (s.kind) {
      case Stmt::Kind::kText: out += s.text; return Flow::kNormal;
      case Stmt::Kind::kOutput: out += to_str(eval(*s.expr)); return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (size_t k = 0; k < s.conditions.size(); ++k) {
          if (truthy(eval(*s.conditions[k]))) return exec(s.bodies[k], out);
        }
        return exec(s.else_body, out);
      case Stmt::Kind::kFor: return exec_for(s, out);
      case Stmt::Kind::kSet: {
        Value v = eval(*s.expr);
        if (!s.attribute.empty()) {
          Value ns = lookup(s.targets[0]);
          if (ns.kind != Value::Kind::kNamespace) {
            fail(s.line, "`set " + s.targets[0] + "." + s.attribute + "` needs " + s.targets[0] +
                             " to be a namespace(), it is " + type_name(ns));
          }
          (*ns.ns)[s.attribute] = to_json(v, s.line);
          return Flow::kNormal;
        }
        assign(s.targets, v, s.line);
        return Flow::kNormal;
      }
      case Stmt::Kind::kSetBlock: {
        std::string captured;
        exec(s.body, captured);
        frames_.back()[s.targets[0]] = Value::data(captured);
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak:
        if (loops_ == 0) fail(s.line, "`break` outside a for loop");
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        if (loops_ == 0) fail(s.line, "`continue` outside a for loop");
        return Flow::kContinue;
      case Stmt::Kind::kGeneration: return exec(s.body, out);
    }
    return Flow::kNormal;
  }

  void assign(const std::vector<std::string>& targets, const Value& v, int line) {
    if (targets.size() == 1) {
      frames_.back()[targets[0]] = v;
      return;
    }
    const std::vector<Value> items = iterate(v, line);
    if (items.size() != targets.size()) {
      fail(line, "cannot unpack " + std::to_string(items.size()) + " values into " +
                     std::to_string(targets.size()) + " names");
    }
    for (size_t k = 0; k < targets.size(); ++k) frames_.back()[targets[k]] = items[k];
  }

  Flow exec_for(const Stmt& s, std::string& out) {
    std::vector<Value> items = iterate(eval(*s.expr), s.line);
    frames_.emplace_back();
    ++loops_;
    if (s.condition) {
      std::vector<Value> kept;
      for (const auto& item : items) {
        assign(s.targets, item, s.line);
        if (truthy(eval(*s.condition))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const auto n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      assign(s.targets, items[static_cast<size_t>(k)], s.line);
      Json loop = Json::object();
      loop["index"] = k + 1;
      loop["index0"] = k;
      loop["revindex"] = n - k;
      loop["revindex0"] = n - k - 1;
      loop["first"] = k == 0;
      loop["last"] = k == n - 1;
      loop["length"] = n;
      loop["depth"] = 1;
      loop["depth0"] = 0;
      frames_.back()["loop"] = Value::data(loop);
      if (exec(s.body, out) == Flow::kBreak) break;
    }
    --loops_;
    frames_.pop_back();
    if (n == 0) exec(s.else_body, out);
    return Flow::kNormal;
  }

  Value lookup(const std::string& name) const {
    for (auto f = frames_.rbegin(); f != frames_.rend(); ++f) {
      if (auto it = f->find(name); it != f->end()) return it->second;
    }
    return Value::undefined("'" + name + "' is undefined");
  }

  std::vector<Value> iterate(const Value& v, int line) const {
    try {
      return values::iterate(v);
    } catch (const values::TypeError& e) {
      fail(line, e.what());
    }
  }
  Json to_json(const Value& v, int line) const {
    try {
      return values::to_json(v);
    } catch (const values::TypeError& e) {
      fail(line, e.what());
    }
  }

  Value eval(const Expr& e) {
    try {
      return eval_unchecked(e);
    } catch (const values::TypeError& error) {
      fail(e.line, error.what());
    }
  }

  std::vector<Value> eval_args(const Expr& e, size_t from) {
    std::vector<Value> out;
    for (size_t k = from; k < e.args.size(); ++k) out.push_back(eval(*e.args[k]));
    return out;
  }
  values::Keywords eval_keywords(const Expr& e) {
    values::Keywords out;
    for (const auto& [key, value] : e.keywords) out.emplace_back(key, eval(*value));
    return out;
  }

  Value eval_unchecked(const Expr& e) {
    using K = Expr::Kind;
    switch (e.kind) {
      case K::kLiteral: return Value::data(e.value);
      case K::kName: return lookup(e.text);
      case K::kList: {
        Json list = Json::array();
        for (const auto& item : e.args) list.push_back(values::to_json(eval(*item)));
        return Value::data(list);
      }
      case K::kDict: {
        Json dict = Json::object();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          const Value key = eval(*e.args[k]);
          dict[values::to_str(key)] = values::to_json(eval(*e.args[k + 1]));
        }
        return Value::data(dict);
      }
      case K::kAttr: return values::get_attr(eval(*e.args[0]), e.text);
      case K::kItem: return values::get_item(eval(*e.args[0]), eval(*e.args[1]));
      case K::kSlice: {
        Value parts[3];
        for (int k = 0; k < 3; ++k) {
          if (e.args[static_cast<size_t>(k) + 1])
            parts[k] = eval(*e.args[static_cast<size_t>(k) + 1]);
        }
        return values::slice(eval(*e.args[0]), parts[0], parts[1], parts[2]);
      }
      case K::kCall: {
        const Expr& callee = *e.args[0];
        if (callee.kind == K::kAttr) {
          return values::call_method(eval(*callee.args[0]), callee.text, eval_args(e, 1),
                                     eval_keywords(e));
        }
        if (callee.kind == K::kName) {
          if (Value v = lookup(callee.text); v.kind != Value::Kind::kUndefined) {
            throw values::TypeError("'" + callee.text + "' is not callable");
          }
          return values::call_global(callee.text, eval_args(e, 1), eval_keywords(e));
        }
        throw values::TypeError("this expression is not callable");
      }
      case K::kFilter:
        return values::apply_filter(e.text, eval(*e.args[0]), eval_args(e, 1), eval_keywords(e));
      case K::kTest: {
        const bool result = values::apply_test(e.text, eval(*e.args[0]), eval_args(e, 1));
        return Value::data(result != e.negated);
      }
      case K::kUnary: {
        const Value v = eval(*e.args[0]);
        if (e.text == "not") return Value::data(!truthy(v));
        return values::negate(v, e.text == "-");
      }
      case K::kBinary: {
        if (e.text == "and") {
          Value left = eval(*e.args[0]);
          return truthy(left) ? eval(*e.args[1]) : left;
        }
        if (e.text == "or") {
          Value left = eval(*e.args[0]);
          return truthy(left) ? left : eval(*e.args[1]);
        }
        return values::binary(e.text, eval(*e.args[0]), eval(*e.args[1]));
      }
      case K::kCompare:
        return Value::data(values::compare(e.text, eval(*e.args[0]), eval(*e.args[1])));
      case K::kCondition:
        if (truthy(eval(*e.args[0]))) return eval(*e.args[1]);
        return e.args[2] ? eval(*e.args[2])
                         : Value::undefined("the condition was false and there is no else");
    }
    return Value::undefined("");
  }

  const ChatTemplate::Impl& t_;
  std::vector<std::unordered_map<std::string, Value>> frames_;
  int loops_ = 0;
};

}  // namespace

}  // namespace jinja

ChatTemplate ChatTemplate::parse(const std::string& source, const std::string& origin) {
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  impl->origin = origin;
  impl->body = jinja::parse(source, origin);
  ChatTemplate t;
  t.impl_ = std::move(impl);
  return t;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& variables) const {
  if (!impl_) throw Error("ChatTemplate::render on an empty template: parse one first");
  if (!variables.is_object()) {
    throw Error(impl_->origin + ": the chat template's variables must be a JSON object");
  }
  jinja::Renderer r(*impl_, variables);
  return r.run();
}

const std::string& ChatTemplate::source() const {
  static const std::string kEmpty;
  return impl_ ? impl_->source : kEmpty;
}

std::string apply_chat_template(const ChatTemplate& chat_template,
                                const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                const nlohmann::ordered_json& special_tokens,
                                const nlohmann::ordered_json& extra) {
  if (!messages.is_array()) throw Error("apply_chat_template: messages must be a JSON list");
  // Transformers: render(messages=, tools=None, documents=None, add_generation_prompt=,
  // **{**special_tokens_map, **kwargs}).
  nlohmann::ordered_json v = nlohmann::ordered_json::object();
  v["messages"] = messages;
  v["tools"] = nullptr;
  v["documents"] = nullptr;
  v["add_generation_prompt"] = add_generation_prompt;
  if (special_tokens.is_object()) {
    for (const auto& [key, value] : special_tokens.items()) v[key] = value;
  }
  if (extra.is_object()) {
    for (const auto& [key, value] : extra.items()) v[key] = value;
  }
  return chat_template.render(v);
}

}  // namespace difftrain::models
